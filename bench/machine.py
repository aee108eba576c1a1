"""Facts about the machine a benchmark ran on, printed beside its figures.

This project's benchmark machine runs the same code about twice as fast in some hours as in
others, so a figure means little alone: ``calibration_ms`` times a fixed pure-Python job
(the kind of work the hot paths do: hashing and dict inserts) in the same process, just
before the measurements. Compare figures from different runs only together with it.
"""

from __future__ import annotations

import os
import statistics
import time

import xxhash

_CALIBRATION_ITEMS = 100_000


def host_load() -> float:
    """The 1-minute load average: other work on the machine shows here."""
    return os.getloadavg()[0]


def calibration_ms(repeats: int = 5) -> float:
    """Median milliseconds of a fixed job: XXH3 over 100,000 64-byte strings, each result
    inserted in a dict. About 11 ms on this machine in a fast hour."""
    data = [i.to_bytes(8, "little") * 8 for i in range(_CALIBRATION_ITEMS)]
    times: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        table: dict[int, bytes] = {}
        for chunk in data:
            table[xxhash.xxh3_64_intdigest(chunk)] = chunk
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 3)
