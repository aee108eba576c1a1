"""The ``kvindex`` command: main.py, with the views (views.py, render.py) and check-hash."""
