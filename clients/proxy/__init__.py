"""``kvindex proxy``: an OpenAI-compatible router that sends each request to the replica
kvindex picks, in one process with the read path (no extra hop).

The package follows a request through the proxy, one module per concept:

* :mod:`.settings` — :class:`~.settings.ProxySettings`, the ``[proxy]`` table (timeouts,
  attempts, back-off, tokens and keys), frozen and validated, read from file, env and
  command line;
* :mod:`.auth` — the inbound bearer token;
* :mod:`.upstream` — the upstream choice: request body → the same
  :class:`~kvindex.api.score.Scorer` as ``/score`` (tokens through the model's tokenizer,
  the whole conversation; LoRA names, cache salt, session) → the replicas to try, best
  first;
* :mod:`.tokenizers` — the model's tokenizer, a replica's ``/tokenize`` failing over to
  the model's other replicas;
* :mod:`.retry_policy` — which failed attempts go to another replica, after what back-off;
* :mod:`.forwarding` — the forwarder: headers (request id, ``traceparent``, the replica's
  key), retries before the first byte to another replica, timeouts (connect, first byte,
  stream idle, total), the answer streamed byte for byte, each attempt reserved in flight
  on its replica (``ReservationDesk``, over :mod:`kvindex.api.load.reservations`) and
  released at its end;
* :mod:`.metrics` — :class:`~.metrics.ProxyMetrics`, the ``kvindex_proxy_*`` series;
* :mod:`.app` — the routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
  ``/health``, ``/healthz``, ``/readyz``, ``/metrics``, and any other ``/v1/*`` passed
  through) and the one error mapping;
* :mod:`.service` — the process: the read path assembled as ``kvindex serve`` (memory store
  and its own subscriber) or ``kvindex api`` (Redis) do, under uvicorn; SIGTERM drains
  (no new connection, the answers in progress finish).

Planned for the rest of the issue (not here yet): ``health`` (active checks and a circuit
breaker per replica, kept in the shared fleet state so that ``/score`` skips an ejected
replica too).
"""
