"""The C allocator pinned at process start, so a large request's buffers go back to the system:
glibc's mmap and trim thresholds set explicitly (:data:`MMAP_THRESHOLD_BYTES`,
:data:`TRIM_THRESHOLD_BYTES`), or else glibc raises the mmap threshold after one large
request and the heaps stay at their peak. Without glibc: nothing."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("kvindex.allocator")

MMAP_THRESHOLD_BYTES = 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def pin_allocator(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Set glibc's mmap and trim thresholds for this process; True when both were set.
    A no-op (logged at debug) without glibc, or when the operator set either through
    glibc's own environment variables (theirs win)."""
    chosen = [name for name in _OPERATOR_VARIABLES if name in os.environ]
    if chosen:
        logger.debug("allocator left as %s set it", " and ".join(chosen))
        return False
    libc = _glibc()
    if libc is None:
        logger.debug("allocator left as is: the C library is not glibc")
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    pinned = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    logger.debug(
        "allocator: mmap threshold %d, trim threshold %d bytes: %s",
        mmap_threshold,
        trim_threshold,
        "set" if pinned else "refused",
    )
    return pinned
