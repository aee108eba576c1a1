"""``kvindex proxy``: an OpenAI-compatible router sending each request to the replica kvindex
picks, in one process with the read path (``service.py`` builds it)."""
