"""The watch's back-off: jittered, doubling, bounded, and back to its floor after a success
(the watch itself runs against a Kubernetes API stand-in: tests/integration/test_discovery.py)."""

from __future__ import annotations

from kvindex.indexer.fleet.pod_watch import Backoff


def test_the_back_off_doubles_up_to_its_bound_each_wait_jittered() -> None:
    backoff = Backoff((0.5, 4.0))
    waits = [backoff.next_wait() for _ in range(8)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True))
    backoff.reset()
    assert backoff.next_wait() <= 0.5
