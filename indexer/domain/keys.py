"""Block keys from token ids, never from an engine's hashes: XXH3-64 over ``parent key (u64) |
token ids (u32 each) | msgpack(extra keys)``, little-endian, chained from the model's root; extra
keys as vLLM's per-block ``extra_keys``. ``api/`` and ``clients/`` import it."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from kvindex.indexer import native
from kvindex.indexer.domain.errors import KvIndexError

KEY_SCHEME = "xxh3-64/v1"
"""Stored beside the index, so a change of key function is loud."""

_ROOT_PREFIX = b"kvindex/" + KEY_SCHEME.encode() + b"\x00"
_TOKEN_BYTES = 4
_hash = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.encode


class BlockKeyError(KvIndexError):
    """Token ids or extra keys that cannot form a block key."""


def model_root(model: str) -> int:
    return _hash(_ROOT_PREFIX + model.encode("utf-8"))


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32. Raises :class:`BlockKeyError` for ids outside u32."""
    try:
        if type(token_ids) in (list, tuple):
            return native.pack_tokens(token_ids)
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise BlockKeyError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _extra_bytes(extra: object) -> bytes:
    if extra is None or extra in ((), []):
        return b""
    try:
        return _encode(extra)
    except (TypeError, OverflowError) as exc:
        raise BlockKeyError(f"extra keys are not encodable: {extra!r}") from exc


_LAYOUTS: dict[int, tuple[str, Callable[[int, bytes], bytes]]] = {}
_MAX_LAYOUTS = 16


def _block_layout(stride: int) -> tuple[str, Callable[[int, bytes], bytes]]:
    # The block format and the (parent, block bytes) packer; a dict: cheaper than lru_cache.
    layout = _LAYOUTS.get(stride)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # odd block sizes in bad input must not pile up
            _LAYOUTS.clear()
        layout = _LAYOUTS[stride] = (f"{stride}s", struct.Struct(f"<Q{stride}s").pack)
    return layout


def chain_keys(
    parent: int,
    token_bytes: bytes,
    block_size: int,
    extra_keys: Sequence[object] | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_bytes``, chained from ``parent``; ``extra_keys``
    has one entry per block (fewer: :class:`BlockKeyError`)."""
    if block_size <= 0:
        raise BlockKeyError(f"block size must be positive, got {block_size}")
    stride = block_size * _TOKEN_BYTES
    num_blocks = len(token_bytes) // stride
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise BlockKeyError(f"{len(extra_keys)} extra keys for {num_blocks} blocks")
    if extra_keys is None:
        as_bytes = token_bytes if type(token_bytes) is bytes else bytes(token_bytes)
        return native.chain(parent, as_bytes, block_size)
    # One C call splits the blocks and one packs each block's bytes and its parent.
    block_format, pack = _block_layout(stride)
    used = num_blocks * stride
    whole = token_bytes if used == len(token_bytes) else memoryview(token_bytes)[:used]
    keys: list[int] = []
    blocks = struct.iter_unpack(block_format, whole)
    for (chunk,), extra in zip(blocks, extra_keys, strict=False):
        parent = _hash(pack(parent, chunk) + _extra_bytes(extra))
        keys.append(parent)
    return keys


def request_extra_keys(
    num_blocks: int, lora_name: str | None = None, cache_salt: str | None = None
) -> list[tuple[object, ...] | None] | None:
    """Per-block extra keys of a text-only request, as vLLM publishes them (None: none)."""
    if lora_name is None and cache_salt is None:
        return None
    extras: list[tuple[object, ...] | None] = []
    for i in range(num_blocks):
        items: list[object] = []
        if lora_name is not None:
            items.append(lora_name)
        if cache_salt is not None and i == 0:
            items.append(cache_salt)
        extras.append(tuple(items) if items else None)
    return extras


def block_keys(
    model: str,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Keys of every full block of a prompt, as the index stores them (a router's one call)."""
    num_blocks = len(token_ids) // block_size if block_size > 0 else 0
    extras = request_extra_keys(num_blocks, lora_name, cache_salt)
    if extras is None and block_size > 0:  # the ids of whole blocks hashed, no bytes built
        try:
            return native.chain_tokens(model_root(model), token_ids, block_size)
        except (OverflowError, TypeError) as exc:
            raise BlockKeyError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    num_used = num_blocks * block_size
    # Only whole blocks are keyed (and checked); copy the ids only if some are left over.
    used = token_ids if num_used == len(token_ids) else token_ids[:num_used]
    return chain_keys(model_root(model), tokens_to_bytes(used), block_size, extras)
