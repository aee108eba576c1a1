"""The compiled hot loops (Cython, built by ``pip install``; ``_core.pyx``, ``_lookup.pyx``,
``_json.pyx``): each name here is the compiled object, or None when the extension is not built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvindex.indexer.native._core import KeyCache as _KeyCache
    from kvindex.indexer.native._core import NativeBatch as _NativeBatch
    from kvindex.indexer.native._core import PackedTokens as _PackedTokens
    from kvindex.indexer.native._core import Tables as _Tables
    from kvindex.indexer.native._core import _KeyCache as _AnyKeyCache

chain: Callable[[int, bytes, int], list[int]] | None = None
chain_tokens: Callable[[int, Sequence[int], int], list[int]] | None = None
pack_tokens: Callable[[Sequence[int]], bytes] | None = None
store_chain: (
    Callable[[list[Any], _AnyKeyCache, object, object, Sequence[int], int, bytes, int], int] | None
) = None
remove_ops: Callable[[list[Any], object, object, Sequence[int]], None] | None = None
Tables: type[_Tables] | None = None
PackedTokens: type[_PackedTokens] | None = None
packed_tokens: Callable[[object], _PackedTokens | None] | None = None
unsigned_hashes: Callable[[object], tuple[int, ...] | None] | None = None
NativeBatch: type[_NativeBatch] | None = None
KeyCache: type[_KeyCache] | None = None
native_live: Callable[[list[bytes]], _NativeBatch | None] | None = None
try:
    from kvindex.indexer.native import _core
except ImportError:  # not built: the pure-Python paths serve
    pass
else:
    chain, chain_tokens, pack_tokens = _core.chain, _core.chain_tokens, _core.pack_tokens
    store_chain, remove_ops, Tables = _core.store_chain, _core.remove_ops, _core.Tables
    PackedTokens, packed_tokens = _core.PackedTokens, _core.packed_tokens
    unsigned_hashes = _core.unsigned_hashes
    NativeBatch, native_live = _core.NativeBatch, _core.native_live
    KeyCache = _core.KeyCache
    Sequence.register(PackedTokens)
