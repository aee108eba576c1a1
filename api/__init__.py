"""kvindex read path: a request → block keys → index lookup → load → policy → the answer.

``score.py`` (one request's steps) · ``runtime.py`` (the one assembly) · ``lookup/`` ·
``decision/`` (policies, candidates, top-k, fast ``kv_aware``, rules) · ``answer.py`` ·
``health/`` · ``load/`` · ``tokenize/`` · ``http/`` (app, fast ``/score`` doors, server) ·
``config/`` · ``loop/`` (off-loop calls, periodic work) · ``schemas.py`` (wire bodies).
"""
