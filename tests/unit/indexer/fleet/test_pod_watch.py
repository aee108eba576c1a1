"""The watch's back-off (jittered, doubling, bounded) and its events (the versions they move,
the errors they raise); lists and watches over HTTP: tests/integration/test_discovery.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.pod_watch import Backoff, PodWatch, _GoneError
from kvindex.indexer.fleet.pods import Pod, Target, WatchEvent
from kvindex.indexer.fleet.settings import DiscoverySettings


def test_the_back_off_doubles_up_to_its_bound_each_wait_jittered() -> None:
    backoff = Backoff((0.5, 4.0))
    waits = [backoff.next_wait() for _ in range(8)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True))
    backoff.reset()
    assert backoff.next_wait() <= 0.5


class _Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def reset(self, pods: list[Pod], target: Target | None) -> None:
        self.seen.append(("reset", ",".join(p.metadata.name for p in pods)))

    def update(self, pod: Pod) -> None:
        self.seen.append(("update", pod.metadata.name))

    def delete(self, pod: Pod) -> None:
        self.seen.append(("delete", pod.metadata.name))


def _event(kind: str, obj: dict[str, Any]) -> WatchEvent:
    return msgspec.json.decode(msgspec.json.encode({"type": kind, "object": obj}), type=WatchEvent)


def test_events_move_the_version_bookmarks_tell_nothing_else_errors_raise() -> None:
    from kubernetes import client  # noqa: PLC0415 (as the watch imports it)

    sink = _Sink()
    watch = PodWatch(DiscoverySettings(selector="a=b", ports=(80,)), sink, client.ApiClient())
    try:
        meta = {"name": "p", "resourceVersion": "7"}
        watch._on_event(_event("ADDED", {"metadata": meta}))
        watch._on_event(_event("BOOKMARK", {"metadata": {"resourceVersion": "9"}}))
        assert watch._version == "9"
        watch._on_event(_event("DELETED", {"metadata": {**meta, "resourceVersion": "10"}}))
        assert sink.seen == [("update", "p"), ("delete", "p")]
        with pytest.raises(_GoneError):
            watch._on_event(_event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"}))
        with pytest.raises(KvIndexError, match="watch error 500"):
            watch._on_event(_event("ERROR", {"kind": "Status", "code": 500}))
    finally:
        watch.stop()
