"""kvindex read path: a request → block keys → index lookup → load → policy → the answer
(``score.py``), assembled by ``runtime.py``; the docs' module map draws its rooms."""
