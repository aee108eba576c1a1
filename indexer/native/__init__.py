"""Compiled hot loops (Cython, built by ``pip install``): block-key chaining and the memory
store's tables (``_core.pyx``; its types in ``_core.pyi``).

Each name is the compiled object, or None when the extension is not built (a checkout used
without an install): callers then fall back to the pure-Python code, which stays the
reference the tests compare the compiled code with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvindex.indexer.native._core import Tables as _Tables

chain: Callable[[int, bytes, int], list[int]] | None = None
chain_tokens: Callable[[int, Sequence[int], int], list[int]] | None = None
Tables: type[_Tables] | None = None
try:
    from kvindex.indexer.native import _core
except ImportError:  # not built: the pure-Python paths serve
    pass
else:
    chain, chain_tokens, Tables = _core.chain, _core.chain_tokens, _core.Tables
