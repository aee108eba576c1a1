"""kvindex write path: vLLM KV events → ordered, gap-aware ingestion → block index.

Data flow, one module per step::

    wire.py        frames → domain events (events.py); the only module that knows msgpack
    stream.py      per-stream ordering: seq tracking, gaps, replay, engine restarts
    replay.py      the DEALER client for vLLM's replay ROUTER
    ingest.py      domain events → index operations (block keys via keys.py)
    index.py       the BlockIndex Protocol; memory_store.py and redis_store.py implement it
    redis_schema.py every Redis key name (versioned, prefixed, Cluster hash-tagged)
    subscriber.py  ZeroMQ sockets, topologies, reconnects; drives the above
    registry.py    the replicas (config file, command line, run-time changes, staleness)
    settings.py    the one typed settings object of an indexer process
"""
