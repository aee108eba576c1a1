"""kvindex write path: vLLM KV events → ordered, gap-aware ingestion → block index.

Rooms, bottom up (a room imports only from those above it in this list)::

    native/   compiled hot loops (Cython); each names its Python reference
    domain/   events, block keys, a stream's health record, the root errors
    redis/    the Redis client, every key name (schema), the one Lua loader
    index/    the BlockIndex Protocol, its memory and Redis backends, the store circuit
    fleet/    replicas, their records (registry), shared over Redis (sync, view)
    config/   the one typed settings object of an indexer process
    ingest/   wire decoding, per-stream ordering, the pipeline, sockets and workers, leases
    service.py, status_server.py, metrics.py: one indexer process, its status port, its series
"""
