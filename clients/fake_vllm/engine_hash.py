"""The engine's own block hashes: what every stand-in for vLLM publishes as ``block_hashes``.

vLLM hashes each full block from its parent's hash, its token ids and its extra keys,
starting at a root (``NONE_HASH``: random, or fixed by ``PYTHONHASHSEED``), and publishes
the digest's last 8 bytes. The stand-ins here (the replica simulator, the fleet simulator,
the benchmarks) chain the same inputs the same way with XXH3-64, seeded with the parent's
hash: uniform over u64 (half of the values ≥ 2**63), and a function of the root, so replicas
with different roots publish different hashes for the same tokens, as vLLM replicas with
different seeds do.

This is deliberately not kvindex's block key (:mod:`kvindex.indexer.domain.keys`): the indexer must
map engine hashes to its own keys through the events' token ids, as it must with a real vLLM.
"""

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
    """An engine's chain root (the parent of every first block), like vLLM's ``NONE_HASH``:
    the same ``seed`` always gives the same root; ``None`` gives a random one."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "big")
    return _hash(_ROOT_PREFIX + str(seed).encode())


def engine_chain(
    parent: int,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKeys] | None = None,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent``.

    ``parent`` is the root (:func:`engine_root`) for a sequence's first block, or the hash of
    the block before ``token_ids[0]``. A trailing partial block gets no hash. Block ``i``'s
    hash is XXH3-64 of its token ids (little-endian u32) and, when ``extra_keys[i]`` is
    neither None nor empty, their msgpack, seeded with the previous hash. ``extra_keys``,
    when given, has an entry for every full block (fewer raises ValueError).
    """
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
