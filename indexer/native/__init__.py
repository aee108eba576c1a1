"""The compiled hot loops (Cython: ``_core.pyx``, ``_lookup.pyx``, ``_json.pyx``), built by every
install; importing the package without the built extension raises ImportError."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.indexer.native._core import (
    KeyCache,
    NativeBatch,
    PackedTokens,
    Tables,
    chain,
    chain_tokens,
    native_live,
    pack_tokens,
    packed_tokens,
    remove_ops,
    store_chain,
    unsigned_hashes,
)

Sequence.register(PackedTokens)

__all__ = [
    "KeyCache",
    "NativeBatch",
    "PackedTokens",
    "Tables",
    "chain",
    "chain_tokens",
    "native_live",
    "pack_tokens",
    "packed_tokens",
    "remove_ops",
    "store_chain",
    "unsigned_hashes",
]
