"""Replica load: pushed (``POST /load``) or scraped from vLLM's ``/metrics``, kept in a store
(in process or Redis) with the ``/score`` answers that chose each replica since, and the
requests in flight that proxies reserve (:mod:`~kvindex.api.load.reservations`)."""
