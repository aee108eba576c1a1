"""The block index: one Protocol (protocol.py), an in-process backend (memory.py) and a
Redis one (redis.py, with its Lua scripts); one contract suite (tests/contract) holds both
to the same guarantees."""
