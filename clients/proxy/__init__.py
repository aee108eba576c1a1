"""``kvindex proxy``: an OpenAI-compatible router that sends each request to the replica
kvindex picks, in one process with the read path (no extra hop).

The package follows a request through the proxy, one module per concept:

* :mod:`.settings` — :class:`~.settings.ProxySettings`, the ``[proxy]`` table (timeouts,
  attempts), frozen and validated;
* :mod:`.upstream` — the upstream choice: request body → the same
  :class:`~kvindex.api.score.Scorer` as ``/score`` (tokens through the model's tokenizer,
  the whole conversation) → the replicas to try, best first;
* :mod:`.forwarding` — the forwarder: headers (request id, ``traceparent``), retries before
  the first byte to another replica, timeouts, the answer streamed byte for byte;
* :mod:`.metrics` — :class:`~.metrics.ProxyMetrics`, the ``kvindex_proxy_*`` series;
* :mod:`.app` — the routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
  ``/health``, ``/healthz``, ``/readyz``, ``/metrics``) and the one error mapping;
* :mod:`.service` — the process: the read path assembled as ``kvindex serve`` (memory store
  and its own subscriber) or ``kvindex api`` (Redis) do, under uvicorn; SIGTERM drains
  (no new connection, the answers in progress finish).

Planned for the rest of the issue (not here yet): ``reservation`` (in-flight requests and
prefill tokens per replica, reserved on dispatch and released at the last byte, held under
a per-proxy lease in the load store), ``health`` (active checks and a circuit breaker per
replica, kept in the shared fleet state so that ``/score`` skips an ejected replica too;
the drain then also releases the reservations), and a pass-through of any other ``/v1/*``
route.
"""
