"""The test process's cyclic garbage collector, paused while a test bounds a latency.

By the end of a whole run the test process holds some 600,000 objects, and a full
collection then took 0.22-0.35 s on a 2-core host (measured with ``gc.callbacks`` during
``make test``). It stops every thread of the process, the API or server under test
included when a test runs it in a thread, so a test that bounds an answer in fractions of
a second would time the collector, not the code under test: one 0.56 s answer out of 50
failed the Redis-outage test that way. A kvindex process holds far less (an API process
about 80,000 objects after start; a full collection 13-21 ms).

Tests marked ``latency_bound`` run with the collector paused (``tests/conftest.py``):
collected before, off during, restored and collected after. Nothing they time is faster for it:
reference counting still frees everything that is not in a cycle.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Collect now, keep the cyclic collector off for the body, restore it and collect
    again: cycles the body left are freed here, not by a collection that an allocation in
    a later test sets off. (Their finalizers would run at a random point of that test:
    without this collection, a replay test that expects EMFILE from a full zmq context got
    ENOTSOCK once in four runs, most likely a finalizer run between the failed
    ``zmq_socket`` and pyzmq's read of ``errno``; none in six runs with it.)"""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()  # what the body left in cycles, before the next test's code runs
