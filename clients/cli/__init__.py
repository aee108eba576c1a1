"""The ``kvindex`` command (main.py): thin shells over the library; the operator views
(views.py: residency, score, replicas, stats), the indexer's status line (status.py) and
``check-hash`` (check_hash.py)."""
