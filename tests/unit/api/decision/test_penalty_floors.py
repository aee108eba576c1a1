"""kvindex.api.decision.penalty_floors: the floors a scorer keeps follow every change that matters.

The equivalence suite (``test_score_equivalence.py``) holds answers made from kept floors to
the plain path's over random sequences of changes; these are the cases by name: a load
changed by another API process (the Redis load store's change log), weights changed by a
request, the clock passing the floors' window, a store read whole again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from unittest.mock import patch

import fakeredis
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision import penalty_floors
from kvindex.api.load.model import Load
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.api.schemas import ScoreRequest
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.schema import Schema

pytestmark = pytest.mark.skipif(not penalty_floors.available(), reason="not compiled")


@pytest.fixture(autouse=True)
def _floors_for_small_fleets() -> Iterator[None]:
    """Floors from one candidate on (these fleets are below the configured threshold)."""
    with patch.object(penalty_floors, "MIN_CANDIDATES", 1):
        yield


NOW = 1_000_000.0
NUM_REPLICAS = 40


def _busy(i: int, ts: float = NOW) -> Load:
    """Replica ``i``'s load: the higher ``i``, the busier."""
    return Load(float(i + 1), 1.0, 0.01 * i, ts, "push")


class Api:
    """A scorer over ``loads`` (40 replicas, r0 the idlest), counting floors made."""

    def __init__(self, loads: LoadStore, clock: Callable[[], float] = lambda: NOW) -> None:
        specs = tuple(ReplicaSpec(f"r{i}", "m") for i in range(NUM_REPLICAS))
        registry = Registry(specs, clock=lambda: NOW)
        for spec in specs:
            registry.record(StreamId(spec.id), StreamReport(last_seq=0, last_event_ts=NOW))
        self.scorer = Scorer(
            ApiSettings(seed=1),
            MemoryIndex(),
            registry,
            loads,
            tokenizers=lambda _: None,
            blocking_store=False,
            clock=clock,
        )
        self.made = 0

    def best(self, top_k: int = 2, weights: dict[str, float] | None = None) -> list[str]:
        request = ScoreRequest(
            model="m", token_ids=list(range(64)), top_k=top_k, weights=weights, dry_run=True
        )
        made = penalty_floors.PenaltyFloors.__init__

        def counted(floors: penalty_floors.PenaltyFloors, *args: object, **kw: object) -> None:
            self.made += 1
            made(floors, *args, **kw)  # type: ignore[arg-type]

        with patch.object(penalty_floors.PenaltyFloors, "__init__", counted):
            answer = asyncio.run(self.scorer.score(request))
        return [e.replica for e in answer.scores]


def _fill(store: LoadStore) -> None:
    for i in range(NUM_REPLICAS):
        store.put(f"r{i}", _busy(i))


def test_a_load_put_by_another_process_is_seen_through_the_redis_change_log() -> None:
    server = fakeredis.FakeServer()
    ours = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    theirs = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    _fill(theirs)
    ours.get_counted(["r0"])  # the first read is a whole one: it empties the snapshot first
    api = Api(ours)
    assert api.best() == ["r0", "r1"]
    assert api.best() == ["r0", "r1"]
    assert api.made == 1  # the second answer used the floors kept
    theirs.put("r39", Load(0.0, 0.0, 0.0, NOW + 1.0, "push"))  # the busiest becomes idle
    theirs.put("r0", _busy(30, NOW + 1.0))  # the idlest becomes busy
    assert api.best() == ["r39", "r1"]
    assert api.made == 1  # ... through the floors kept, the two changed ones computed


def test_answers_counted_by_another_process_are_changes_too() -> None:
    server = fakeredis.FakeServer()
    ours = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    theirs = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    _fill(theirs)
    theirs.put("r0", _busy(1))  # r0 and r1 tie: the draw orders them
    api = Api(ours)
    assert set(api.best()) == {"r0", "r1"}
    theirs.get_counted(["r0"], ["r0"] * 5)  # five answers elsewhere: r0 is no longer idle
    assert api.best() == ["r1", "r2"]


def test_weights_of_a_request_have_floors_of_their_own() -> None:
    loads = MemoryLoadStore()
    _fill(loads)
    loads.put("r39", Load(0.0, 0.0, 0.0, NOW, "push"))
    loads.put("r38", Load(0.0, 50.0, 0.0, NOW, "push"))  # only waiting: free if not weighed
    api = Api(loads)
    assert api.best() == ["r39", "r0"]
    no_waiting = {"waiting": 0.0}
    assert set(api.best(weights=no_waiting)) == {"r38", "r39"}  # a tie at 0
    assert api.best() == ["r39", "r0"]
    assert set(api.best(weights=no_waiting)) == {"r38", "r39"}
    assert api.made == 2  # one per weights, each kept


def test_floors_are_made_again_once_the_clock_passes_their_window() -> None:
    clock = [NOW]
    loads = MemoryLoadStore()
    for i in range(NUM_REPLICAS):  # r0 idle but measured long ago; the rest decay slowly
        loads.put(f"r{i}", _busy(i))
    api = Api(loads, lambda: clock[0])
    assert api.best() == ["r0", "r1"]
    clock[0] += 0.1
    assert api.best() == ["r0", "r1"] and api.made == 1
    clock[0] += 60.0  # six half-lives: every load nearly forgotten, floors out of date
    assert api.best(top_k=3) == ["r0", "r1", "r2"]
    assert api.made == 2


def test_a_snapshot_emptied_by_an_outage_makes_the_floors_again() -> None:
    client = fakeredis.FakeRedis()
    loads = RedisLoadStore(client, Schema("p"))
    _fill(loads)
    loads.get_counted(["r0"])  # the first read is a whole one
    api = Api(loads)
    assert api.best() == ["r0", "r1"]
    with patch.object(loads, "_read_changes", side_effect=IndexUnavailableError("down")):
        assert api.best() == ["r0", "r1"]  # the last loads read, every penalty computed
    loads.put("r39", Load(0.0, 0.0, 0.0, NOW + 1.0, "push"))
    assert api.best() == ["r39", "r0"]
    assert api.made == 2


def test_below_the_threshold_every_penalty_is_computed() -> None:
    loads = MemoryLoadStore()
    _fill(loads)
    api = Api(loads)
    with patch.object(penalty_floors, "MIN_CANDIDATES", NUM_REPLICAS + 1):
        assert api.best() == ["r0", "r1"]
    assert api.made == 0
    assert api.best() == ["r0", "r1"]
    assert api.made == 1
