"""kvindex write path: vLLM KV events → ordered, gap-aware ingestion → block index.

Data flow, one module per step::

    wire.py        frames → domain events (events.py); the only module that knows msgpack
    stream.py      per-stream ordering: seq tracking, gaps, replay, engine restarts
    replay.py      the DEALER client for vLLM's replay ROUTER
    ingest.py      domain events → index operations (block keys via keys.py)
    health.py      a stream's health record, and the report that updates it
    pipeline.py    the socket-free core: drives the above, decides replays, purges, recovery
    subscriber.py  ZeroMQ sockets, topologies, reconnects; feeds the pipeline
    index/         the BlockIndex Protocol; memory.py and redis.py implement it
    redis_schema.py every Redis key name (versioned, prefixed, Cluster hash-tagged)
    fleet/         the replicas (replica.py), their records (registry.py), shared over
                   Redis (sync.py writes, view.py reads for API processes)
    settings.py    the one typed settings object of an indexer process
"""
