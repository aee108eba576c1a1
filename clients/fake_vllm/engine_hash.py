"""The engine's own block hashes (XXH3-64 chained from a root per engine, like vLLM's
``NONE_HASH``), deliberately not kvindex's block keys, as with a real vLLM."""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec
import xxhash

from kvindex.indexer.domain.events import ExtraKeys
from kvindex.indexer.domain.keys import tokens_to_bytes

_ROOT_PREFIX = b"kvindex/fake-vllm/root\x00"
_TOKEN_BYTES = 4
_hash = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.encode


def engine_root(seed: int | str | None = None) -> int:
    """An engine's chain root: the same ``seed`` gives the same root; None a random one."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "big")
    return _hash(_ROOT_PREFIX + str(seed).encode())


def engine_chain(
    parent: int,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKeys] | None = None,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from ``parent``; ``extra_keys``: one a block."""
    stride = block_size * _TOKEN_BYTES
    data = memoryview(tokens_to_bytes(token_ids))
    num_bytes = len(data) // stride * stride
    if extra_keys is not None and len(extra_keys) < num_bytes // stride:
        raise ValueError(f"{len(extra_keys)} extra keys for {num_bytes // stride} blocks")
    hashes: list[int] = []
    append = hashes.append
    if extra_keys is None:
        for start in range(0, num_bytes, stride):
            parent = _hash(data[start : start + stride], parent)
            append(parent)
        return hashes
    for start, extra in zip(range(0, num_bytes, stride), extra_keys, strict=False):
        block = data[start : start + stride]
        parent = _hash(bytes(block) + _encode(extra) if extra else block, parent)
        append(parent)
    return hashes
