"""Replica load: what it is, where it is kept, and how it is scraped from vLLM.

The scorer trades cache hits against each replica's load. Load arrives two ways:

* pushed (``POST /load``): a replica or router reports running and waiting requests and
  KV-cache usage (``source = "push"``);
* scraped: :class:`~kvindex.api.load.scraper.MetricsScraper` GETs each replica's vLLM
  Prometheus ``/metrics`` (``source = "scrape"``), parsed by
  :func:`~kvindex.api.load.vllm_metrics.parse_vllm_metrics`.

Load lives in the same kind of store as the index (``MemoryLoadStore`` in-process,
``RedisLoadStore`` shared) so several API processes on one Redis agree. Each ``Load``
carries the time it was measured; the scorer weighs old load less (``Load.age_s``). Stores
keep the newest load per replica: a put never replaces a load measured later, so a late
scrape cannot hide a fresh push, nor the reverse.

Stores also count *answers*: how many ``/score`` answers chose a replica since its current
load was stored (``LoadStore.get_counted``). In Redis every API process sharing the store
counts into the same counter, so answers from all of them weigh as load until the replica
reports again.

A read costs what changed, not the fleet: each store keeps every replica's counted load as
it changes, and the Redis store reads only the replicas changed since its last read (a
change log beside the load hash, with an identity that makes a flushed Redis read whole):
:mod:`~kvindex.api.load.store` says how.

Stores also hold the *requests in flight* that ``kvindex proxy`` processes reserve
(:mod:`~kvindex.api.load.reservations`: each request and its uncached prompt tokens, on its
replica, from dispatch to the last byte, under a lease per proxy that lapses when the proxy
dies). ``get_counted`` reads their totals with the loads, so ``/score`` and every proxy on
one Redis count the same requests.

Modules, in the order data flows through them:

* :mod:`~kvindex.api.load.model`: ``Load`` (always valid), ``CountedLoad``, ``InFlight``,
  ``LoadError`` and the store rule :func:`~kvindex.api.load.model.is_newer_or_same`;
* :mod:`~kvindex.api.load.vllm_metrics`: a ``Load`` from a vLLM ``/metrics`` exposition;
* :mod:`~kvindex.api.load.scraper`: ``MetricsScraper``, which scrapes every replica into a
  store;
* :mod:`~kvindex.api.load.reservations`: the in-flight ``Ledger`` (in-process and Redis),
  ``Reservations`` (one proxy's, under its lease) and the ``LeaseKeeper`` that renews it;
* :mod:`~kvindex.api.load.store`: the ``LoadStore`` Protocol, its in-process and Redis
  implementations (each owns a ledger).
"""
