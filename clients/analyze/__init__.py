"""``kvindex analyze``: what a request log could reuse, what breaks it, and which policy fits.

The data flow: the request log (:mod:`kvindex.clients.request_log`: read; tokenized many
requests a call by batches.py) → the cache walk (cache_walk.py: block keys, the
single-cache ceiling, per-position counts) with the fragmentation finder (fragmentation.py)
and the tree of distinct keys that counts the shared prefixes (prefixes.py) → the verdict
(verdict.py) → the report (report.py) → its table and plot (table.py); run.py is the
command.
"""
