"""Discovery's writes: the routable pods' replicas added, the gone and unready removed, only
what it added removed, a changed spec removed then added, a failed write retried."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvindex.indexer.fleet.discovery import Discovery, start_discovery
from kvindex.indexer.fleet.pods import Pod, Target
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.settings import DiscoverySettings
from kvindex.indexer.index.protocol import IndexUnavailableError
from tests.support.kube_api import pod as pod_object

SETTINGS = DiscoverySettings(selector="app=vllm", ports=(8000, 8001), model="m")
TARGET = Target("app=vllm", (8000, 8001))


def _pod(name: str, ip: str, **kw: Any) -> Pod:
    return msgspec.convert(pod_object(name, ip, **kw), Pod)


def _ids(registry: Registry) -> list[str]:
    return [r.id for r in registry.replicas()]


def test_pods_coming_becoming_ready_and_going_change_the_registry() -> None:
    static = ReplicaSpec("static", "m", events="tcp://10.9.9.9:5557")
    registry = Registry((static,))
    discovery = Discovery(SETTINGS, registry)
    discovery.reset([_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2", ready=False)], TARGET)
    assert discovery.apply()
    assert _ids(registry) == ["a", "a-1", "static"]
    discovery.update(_pod("b", "10.0.0.2"))
    discovery.apply()
    assert _ids(registry) == ["a", "a-1", "b", "b-1", "static"]
    discovery.update(_pod("a", "10.0.0.1", ready=False))
    discovery.delete(_pod("b", "10.0.0.2"))
    discovery.apply()
    assert _ids(registry) == ["static"]  # the declared replica is not discovery's to remove


def test_a_reset_drops_the_pods_no_longer_listed_and_a_lost_pool_drops_them_all() -> None:
    registry = Registry()
    discovery = Discovery(SETTINGS, registry)
    discovery.reset([_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2")], TARGET)
    discovery.apply()
    discovery.reset([_pod("b", "10.0.0.2")], TARGET)
    discovery.apply()
    assert _ids(registry) == ["b", "b-1"]
    discovery.reset([], None)
    discovery.apply()
    assert _ids(registry) == []


def test_a_pod_readdressed_is_removed_then_added_so_its_streams_reopen() -> None:
    calls: list[str] = []

    class Recording(Registry):
        def add(self, spec: ReplicaSpec) -> bool:
            calls.append(f"add {spec.id} {spec.url}")
            return super().add(spec)

        def remove(self, replica: str) -> ReplicaSpec | None:
            calls.append(f"remove {replica}")
            return super().remove(replica)

    registry = Recording()
    discovery = Discovery(DiscoverySettings(selector="a=b", ports=(8000,), model="m"), registry)
    discovery.reset([_pod("a", "10.0.0.1")], Target("a=b", (8000,)))
    discovery.apply()
    discovery.update(_pod("a", "10.0.0.7"))
    discovery.apply()
    assert calls == ["add a http://10.0.0.1:8000", "remove a", "add a http://10.0.0.7:8000"]
    assert registry.get("a") is not None and registry.get("a").url == "http://10.0.0.7:8000"  # type: ignore[union-attr]


def test_a_failed_write_is_counted_and_retried_by_the_next_apply() -> None:
    class Flaky(Registry):
        fail = True

        def add(self, spec: ReplicaSpec) -> bool:
            if self.fail:
                raise IndexUnavailableError("redis down")
            return super().add(spec)

    registry = Flaky()
    discovery = Discovery(SETTINGS, registry)
    discovery.reset([_pod("a", "10.0.0.1")], TARGET)
    assert not discovery.apply()
    assert discovery.num_write_errors == 2 and _ids(registry) == []
    registry.fail = False
    assert discovery.apply()
    assert _ids(registry) == ["a", "a-1"]


def test_a_pod_that_cannot_be_mapped_is_skipped_once_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    discovery = Discovery(DiscoverySettings(selector="a=b", ports=(8000,)), Registry())
    nameless = _pod("a", "10.0.0.1")  # no model anywhere, and no default
    discovery.reset([nameless], Target("a=b", (8000,)))
    discovery.update(nameless)
    assert discovery.wanted() == {}
    assert discovery.num_skipped_pods == 1
    assert "pod a: no kvindex.io/model" in caplog.text


def test_nothing_starts_without_a_pool_or_selector() -> None:
    assert start_discovery(DiscoverySettings(), Registry()) is None


class Ledger(Registry):
    """An in-process registry that keeps a :class:`DiscoveryLedger` too, as Redis does (it
    outlives a :class:`Discovery`); ``down``: every ledger call fails as a store down."""

    def __init__(self) -> None:
        super().__init__()
        self.by: dict[str, str] = {}
        self.down = False

    def discovered(self, source: str) -> set[str]:
        self._check()
        return {replica for replica, by in self.by.items() if by == source}

    def mark_discovered(self, replica: str, source: str) -> None:
        self._check()
        self.by[replica] = source

    def unmark_discovered(self, replica: str) -> None:
        self._check()
        self.by.pop(replica, None)

    def _check(self) -> None:
        if self.down:
            raise IndexUnavailableError("redis down")


def test_the_ledger_names_what_discovery_added_and_forgets_what_it_removed() -> None:
    ledger = Ledger()
    discovery = Discovery(SETTINGS, ledger)
    assert discovery.source == "/selector/app=vllm"
    discovery.reset([_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2")], TARGET)
    discovery.apply()
    discovery.delete(_pod("a", "10.0.0.1"))
    discovery.apply()
    assert ledger.by == {"b": discovery.source, "b-1": discovery.source}


def test_a_restart_s_first_list_removes_its_replicas_whose_pods_went_away_meanwhile() -> None:
    ledger = Ledger()
    before = Discovery(SETTINGS, ledger)
    before.reset([_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2")], TARGET)
    before.apply()
    ledger.add(ReplicaSpec("static", "m", events="tcp://10.9.9.9:5557"))  # not discovery's
    other = Discovery(DiscoverySettings(pool="other", model="m"), ledger)  # another target's
    other.reset([_pod("c", "10.0.0.3")], Target("app=other", (8000,)))
    other.apply()
    after = Discovery(SETTINGS, ledger)  # the process restarted: pod a went away meanwhile
    assert after.apply()  # no list yet: nothing removed
    assert _ids(ledger) == ["a", "a-1", "b", "b-1", "c", "static"]
    after.reset([_pod("b", "10.0.0.2")], TARGET)
    assert after.apply()
    assert _ids(ledger) == ["b", "b-1", "c", "static"]
    assert ledger.discovered(after.source) == {"b", "b-1"}
    assert ledger.discovered(other.source) == {"c"}


def test_a_sweep_that_fails_is_retried_until_it_is_done() -> None:
    ledger = Ledger()
    before = Discovery(SETTINGS, ledger)
    before.reset([_pod("a", "10.0.0.1")], TARGET)
    before.apply()
    after = Discovery(SETTINGS, ledger)
    after.reset([], TARGET)
    ledger.down = True
    assert not after.apply()
    assert _ids(ledger) == ["a", "a-1"]
    ledger.down = False
    assert after.apply()
    assert _ids(ledger) == [] and ledger.by == {}
