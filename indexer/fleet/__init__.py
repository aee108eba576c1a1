"""The fleet: each replica's declaration (replica.py), every stream's health record and
freshness (registry.py), and their shared form in Redis: the indexer writes it (sync.py),
API processes read it (view.py)."""
