"""kvindex read path: a request → block keys → index lookup → load → policy → the answer.

One module per step::

    app.py         the FastAPI routes, the one error → HTTP mapping, bearer auth
    score.py       POST /score as a library call (Scorer): candidates → tokens → keys →
                   lookup → load → policy, every term reported
    policies.py    the pure policies, the kv_aware formula and the dispatch between them
    tokenize/      text and chat → token ids (local tokenizer.json or a replica's /tokenize)
    load/          replica load: the record, its stores, the vLLM /metrics scraper
    schemas.py     request and response bodies (msgspec)
    views.py       the bodies of GET /replicas, /stats, /config
    openapi.py     the OpenAPI document, from the msgspec types
    metrics.py     Prometheus metrics (lookups timed by a wrapping index)
    settings.py    the one typed settings object of an API process
    server.py      assembles `kvindex serve` and `kvindex api`
"""
