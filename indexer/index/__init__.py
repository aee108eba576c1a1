"""The block index: one Protocol, a memory and a Redis backend, one contract suite."""
