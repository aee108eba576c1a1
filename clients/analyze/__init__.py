"""``kvindex analyze``: what a request log could reuse, what breaks it, and which policy fits.

The log is tokenized (batches.py), walked through one cache (cache_walk.py) with the
fragmentation finder and the prefix tree, judged (verdict.py) and reported (report.py,
table.py); run.py is the command."""
