"""The ``kvindex`` command: main.py; the views (views.py, render.py); check-hash (key_check.py)."""
