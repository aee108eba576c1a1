"""The compiled pieces of an event's translation into index operations, in Python: the oracles
``native.pack_tokens``, ``native.store_chain`` and ``native.remove_ops`` are held to.

:func:`python_translation` puts them, and the Python key cache, in the compiled ones' place.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest.mock import patch

from kvindex.indexer import native
from kvindex.indexer.domain.keys import chain_keys
from tests.oracles.key_cache import KeyCache


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)  # OverflowError or TypeError as the compiled one
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def store_chain(
    ops: list[Any],
    cache: KeyCache,
    kind: object,
    tier: object,
    engine_hashes: Sequence[int],
    parent: int,
    token_bytes: bytes,
    block_size: int,
) -> int:
    # Extra keys of None per block: the general loop of chain_keys, hashing the same bytes.
    keys = chain_keys(parent, token_bytes, block_size, [None] * len(engine_hashes))
    for engine_hash, key in zip(engine_hashes, keys, strict=True):
        ops.append((kind, tier, engine_hash, key))
        cache.put(engine_hash, key)
    return len(keys)


def remove_ops(ops: list[Any], kind: object, tier: object, engine_hashes: Sequence[int]) -> None:
    ops.extend([(kind, tier, engine_hash, 0) for engine_hash in engine_hashes])


@contextmanager
def python_translation() -> Iterator[None]:
    """Within: an ``Ingestor`` translates with these oracles and the Python key cache."""
    oracles = {
        "KeyCache": KeyCache,
        "pack_tokens": pack_tokens,
        "store_chain": store_chain,
        "remove_ops": remove_ops,
    }
    with ExitStack() as stack:
        for name, oracle in oracles.items():
            stack.enter_context(patch.object(native, name, oracle))
        yield
