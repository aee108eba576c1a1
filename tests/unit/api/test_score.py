"""kvindex.api.score: ``POST /score`` as a library call, on in-process stores, a fixed clock.

The HTTP behaviour is pinned by tests/integration/test_api.py; these tests pin what the
scorer gathers per candidate (rank, tiers, freshness over data-parallel streams, load age)
and that the stream list it remembers follows the registry."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import fakeredis
import pytest

from kvindex.api import answer as answer_module
from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision.policies import Weights
from kvindex.api.load.model import CountedLoad, Load
from kvindex.api.load.reservations import Reservations
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.api.schemas import (
    FreshnessView,
    LoadView,
    ScoreEntry,
    ScoreRequest,
    ScoreResponse,
)
from kvindex.api.score import KeysMemo, Scorer
from kvindex.api.tokenize.protocol import pack_ids
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import IndexUnavailableError, Op, OpKind
from kvindex.indexer.redis.schema import Schema

MODEL = "m"
NOW = 1_000.0
TOKENS = list(range(1, 65))
"""Four blocks of 16."""
KEYS = block_keys(MODEL, TOKENS, 16)
W = Weights()


class Fleet:
    """Replicas ``a`` (two ranks), ``b`` and ``c`` of one model; a clock the test moves."""

    def __init__(self, loads: LoadStore | None = None) -> None:
        self.now = NOW
        specs = (
            ReplicaSpec("a", MODEL, dp_size=2),
            ReplicaSpec("b", MODEL),
            ReplicaSpec("c", MODEL),
        )
        self.registry = Registry(specs, clock=self.clock)
        self.index = MemoryIndex()
        self.loads = MemoryLoadStore() if loads is None else loads
        self.scorer = Scorer(
            ApiSettings(seed=1),
            self.index,
            self.registry,
            self.loads,
            tokenizers=lambda _: None,
            blocking_store=False,
            clock=self.clock,
        )

    def clock(self) -> float:
        return self.now

    def hold(self, stream: StreamId, num_blocks: int, tier: Tier = Tier.GPU) -> None:
        """The stream holds the request's first blocks, and is heard of now."""
        ops: list[Op] = [(OpKind.STORE, tier, i, k) for i, k in enumerate(KEYS[:num_blocks])]
        self.index.apply(stream, 0, self.now, ops)
        self.registry.record(stream, StreamReport(last_seq=0, last_event_ts=self.now - 0.5))

    def answer(self) -> ScoreResponse:
        return asyncio.run(self.scorer.score(ScoreRequest(model=MODEL, token_ids=TOKENS)))

    def score(self) -> dict[str, ScoreEntry]:
        return {e.replica: e for e in self.answer().scores}

    def best(self) -> str:
        best = self.answer().best
        assert best is not None
        return best

    def routed(self) -> dict[str, int]:
        """Answers counted as load, per replica with a load, as of this answer's read."""
        return {e.replica: e.load.routed for e in self.answer().scores if e.load is not None}


@pytest.fixture
def fleet() -> Fleet:
    fleet = Fleet()
    fleet.now = NOW - 3.0
    fleet.hold(StreamId("a", 0), 1)
    fleet.now = NOW - 1.0
    fleet.hold(StreamId("a", 1), 3)
    fleet.registry.record(StreamId("a", 1), StreamReport(replaying=True))
    fleet.hold(StreamId("b"), 2, Tier.CPU)
    fleet.now = NOW
    fleet.loads.put("a", Load(2.0, 1.0, 0.5, NOW - 10.0, "push"))
    return fleet


def test_replica_is_matched_on_its_best_rank_and_as_fresh_as_its_worst_stream(
    fleet: Fleet,
) -> None:
    a = fleet.score()["a"]
    assert (a.rank, a.matched_blocks, a.matched_tokens) == (1, 3, 48)
    assert a.tiers == {"gpu": 3, "cpu": 0, "other": 0}
    assert a.freshness == FreshnessView("replaying", lag_s=0.5, silent_s=1.0)
    assert a.load == LoadView(2.0, 1.0, 0.5, 10.0, "push")
    recency = 0.5 ** (10.0 / W.load_half_life_s)
    load = (W.waiting * 1.0 + W.running * 2.0) * recency + W.kv_usage * 0.5 * recency
    cache = W.cache * (3 / 4) * W.replaying_factor
    assert a.terms == {
        "cache": cache,
        "freshness_factor": W.replaying_factor,
        "load": -load,
        "load_recency": recency,
        "in_flight": 0.0,
        "in_flight_tokens": 0.0,
    }
    assert a.score == pytest.approx(cache - load)


def test_single_stream_replica_reports_its_stream_and_tiers(fleet: Fleet) -> None:
    b = fleet.score()["b"]
    assert (b.rank, b.matched_blocks) == (0, 2)
    assert b.tiers == {"gpu": 0, "cpu": 2, "other": 0}
    assert b.freshness == FreshnessView("live", lag_s=0.5, silent_s=1.0)
    assert b.load is None
    assert b.terms["cache"] == W.cache * (2 * W.cpu / 4)


def test_replica_never_heard_of_is_stale_without_a_match(fleet: Fleet) -> None:
    c = fleet.score()["c"]
    assert (c.rank, c.matched_blocks, c.tiers) == (0, 0, {"gpu": 0, "cpu": 0, "other": 0})
    assert c.freshness == FreshnessView("stale", lag_s=None, silent_s=None)
    assert c.terms["freshness_factor"] == W.stale_factor


def test_a_replica_whose_events_endpoint_never_answered_is_stale_and_does_not_win(
    fleet: Fleet,
) -> None:
    # c's blocks are in the index (from before an indexer restart); its stream is tracked
    # but its endpoint never answered: nothing vouches for them.
    ops: list[Op] = [(OpKind.STORE, Tier.GPU, i, k) for i, k in enumerate(KEYS[:3])]
    fleet.index.apply(StreamId("c"), 0, NOW, ops)
    fleet.registry.record(StreamId("c"), StreamReport())
    c = fleet.score()["c"]
    assert (c.matched_blocks, c.freshness.state) == (3, "stale")
    assert c.terms["freshness_factor"] == W.stale_factor
    assert fleet.best() != "c"


def test_streams_follow_replicas_added_and_removed(fleet: Fleet) -> None:
    assert set(fleet.score()) == {"a", "b", "c"}
    fleet.registry.add(ReplicaSpec("d", MODEL))
    fleet.hold(StreamId("d"), 4)
    assert fleet.score()["d"].matched_blocks == 4
    fleet.registry.remove("d")
    assert set(fleet.score()) == {"a", "b", "c"}


def test_streams_follow_a_rank_heard_beyond_the_declared_ones(fleet: Fleet) -> None:
    assert fleet.score()["c"].matched_blocks == 0
    fleet.hold(StreamId("c", 2), 2)
    c = fleet.score()["c"]
    assert (c.rank, c.matched_blocks) == (2, 2)


def test_ranks_matching_as_long_leave_the_replica_on_its_lowest(fleet: Fleet) -> None:
    # The index answers its holders in any order: rank 1 seen first must not keep the tie.
    ops: list[Op] = [(OpKind.STORE, Tier.CPU, i, k) for i, k in enumerate(KEYS[:3])]
    fleet.index.apply(StreamId("a", 0), 1, NOW, ops)  # as long as rank 1's, on CPU
    a = fleet.score()["a"]
    assert (a.rank, a.matched_blocks, a.tiers["cpu"]) == (0, 3, 2)  # its first on GPU too
    fleet.index.apply(StreamId("a", 1), 1, NOW, [(OpKind.STORE, Tier.GPU, 3, KEYS[3])])
    assert (fleet.score()["a"].rank, fleet.score()["a"].matched_blocks) == (1, 4)
    assert fleet.answer().num_matched == 2


def test_streams_follow_a_spec_whose_ranks_change(fleet: Fleet) -> None:
    fleet.index.apply(StreamId("b", 1), 0, NOW, [(OpKind.STORE, Tier.GPU, 9, KEYS[0])])
    assert fleet.score()["b"].rank == 0
    fleet.registry.add(ReplicaSpec("b", MODEL, dp_size=2))
    fleet.index.apply(
        StreamId("b", 1), 1, NOW, [(OpKind.STORE, Tier.GPU, i, k) for i, k in enumerate(KEYS)]
    )
    assert (fleet.score()["b"].rank, fleet.score()["b"].matched_blocks) == (1, 4)


def test_answers_count_as_load_until_the_replica_reports_again() -> None:
    """Between two load reports, each answer adds ``weights.routed`` to the chosen replica,
    so equal replicas are chosen in turn instead of all requests going to one."""
    fleet = Fleet()
    for replica in ("a", "b", "c"):
        fleet.loads.put(replica, Load(0.0, 0.0, 0.0, NOW, "push"))

    def best() -> str:
        answer = asyncio.run(fleet.scorer.score(ScoreRequest(model=MODEL, token_ids=TOKENS)))
        assert answer.best is not None
        return answer.best

    assert sorted(best() for _ in range(3)) == ["a", "b", "c"]
    routed = {e.replica: e.load.routed for e in fleet.score().values() if e.load is not None}
    assert routed == {"a": 1, "b": 1, "c": 1}  # (as measured before this fourth answer)
    chosen = best()  # counted in the store by the next read
    fleet.loads.put(chosen, Load(0.0, 0.0, 0.0, NOW + 1.0, "push"))  # a new measurement
    assert fleet.loads.get_counted([chosen])[chosen].routed == 0  # its count starts again
    entries = fleet.score()
    # The answer made just before that measurement is counted only now, toward it: answers
    # in flight when a load is stored are over-counted, never lost.
    assert entries[chosen].load == LoadView(0.0, 0.0, 0.0, 0.0, "push", routed=1)
    assert entries[chosen].terms["load"] == -W.routed
    assert {e.load.routed for r, e in entries.items() if r != chosen and e.load} >= {1}


def test_answers_of_every_api_process_on_one_redis_count_as_load() -> None:
    """Two API processes (two scorers) sharing a Redis load store: each counts the other's
    answers too, one read after they are made (they ride on the answering process's next
    read, which costs no extra round trip)."""
    server = fakeredis.FakeServer()
    first, second = (
        Fleet(RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("t"))) for _ in range(2)
    )
    for replica in ("a", "b", "c"):
        first.loads.put(replica, Load(0.0, 0.0, 0.0, NOW, "push"))
    answers = [first.best() for _ in range(3)]
    assert sorted(answers) == ["a", "b", "c"]
    # The first two were counted by the first process's later reads; the third waits for
    # its next one.
    seen = second.answer()
    routed = {e.replica: e.load.routed for e in seen.scores if e.load is not None}
    assert routed == {answers[0]: 1, answers[1]: 1, answers[2]: 0}
    assert seen.best == answers[2]  # the one replica no counted answer has gone to


@pytest.mark.parametrize("backend", ["memory", "fakeredis"])
def test_requests_in_flight_of_every_proxy_weigh_in_the_answer(backend: str) -> None:
    """Reservations made in the load store (by any proxy) are read with the loads: a
    replica with no load report still pays for its requests in flight, and the answer
    says how much in its terms."""
    store: LoadStore = MemoryLoadStore()
    if backend == "fakeredis":
        store = RedisLoadStore(fakeredis.FakeRedis(), Schema("t"))
    fleet = Fleet(store)
    fleet.loads.put("b", Load(0.0, 0.0, 0.0, NOW, "push"))
    holder = Reservations(fleet.loads.ledger, 10.0, holder="proxy-1")
    holder.reserve("a", 4000)
    holder.reserve("b", 0)
    holder.reserve("b", 0)
    entries = fleet.score()
    assert entries["a"].load is None  # no report: the requests in flight alone weigh
    assert entries["a"].terms["in_flight"] == pytest.approx(-W.in_flight)
    assert entries["a"].terms["in_flight_tokens"] == pytest.approx(-W.in_flight_tokens * 4000)
    assert entries["a"].terms["load"] == pytest.approx(-(W.in_flight + W.in_flight_tokens * 4000))
    assert entries["b"].terms["load"] == pytest.approx(-2 * W.in_flight)
    assert fleet.best() == "c"  # the one with nothing in flight
    holder.close()
    assert fleet.score()["a"].terms["load"] == 0.0


class _FlakyLoads(MemoryLoadStore):
    """A load store that is unreachable while ``down``."""

    down = False

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        if self.down:
            raise IndexUnavailableError("redis: connection refused")
        return super().get_counted(replicas, answers)


def test_answers_not_counted_during_a_load_store_outage_are_dropped() -> None:
    loads = _FlakyLoads()
    fleet = Fleet(loads)
    fleet.loads.put("a", Load(0.0, 0.0, 0.0, NOW, "push"))
    for busy in ("b", "c"):
        fleet.loads.put(busy, Load(50.0, 50.0, 1.0, NOW, "push"))
    assert fleet.best() == "a"  # the idle one; its answer is counted at the next read
    loads.down = True
    assert fleet.routed() == {"a": 0, "b": 0, "c": 0}  # the last loads read, none counted
    assert fleet.routed() == {"a": 0, "b": 0, "c": 0}
    loads.down = False
    assert fleet.routed() == {"a": 1, "b": 0, "c": 0}  # only the answer since the last read


def _scorer_over(view: RedisFleetView) -> Scorer:
    return Scorer(
        ApiSettings(seed=1),
        MemoryIndex(),
        view,
        MemoryLoadStore(),
        tokenizers=lambda _: None,
        blocking_store=False,
    )


def test_a_fleet_never_read_gives_a_degraded_answer_not_an_unknown_model() -> None:
    server = fakeredis.FakeServer()
    server.connected = False  # e.g. a wrong Redis password: the fleet was never readable
    view = RedisFleetView(fakeredis.FakeRedis(server=server), Schema("t"), cache_ttl_s=0.0)
    answer = asyncio.run(_scorer_over(view).score(ScoreRequest(model=MODEL, token_ids=TOKENS)))
    assert (answer.best, answer.scores) == (None, [])
    assert answer.degraded is not None and "fleet state unreadable" in answer.degraded


def test_the_last_fleet_read_is_scored_and_said_degraded_while_redis_is_down() -> None:
    server = fakeredis.FakeServer()
    view = RedisFleetView(fakeredis.FakeRedis(server=server), Schema("t"), cache_ttl_s=0.0)
    view.add(ReplicaSpec("a", MODEL))
    scorer = _scorer_over(view)
    request = ScoreRequest(model=MODEL, token_ids=TOKENS)
    assert asyncio.run(scorer.score(request)).degraded is None
    server.connected = False
    answer = asyncio.run(scorer.score(request))
    assert answer.best == "a"
    assert answer.degraded is not None and "fleet state unreadable" in answer.degraded


def test_a_dry_run_changes_nothing() -> None:
    """Operator views ask without routing: not counted as load, no round-robin turn taken,
    the seeded random sequence left alone."""
    fleet = Fleet()
    for replica in ("a", "b", "c"):
        fleet.loads.put(replica, Load(0.0, 0.0, 0.0, NOW, "push"))

    def best(policy: str, *, dry_run: bool) -> str | None:
        request = ScoreRequest(model=MODEL, token_ids=TOKENS, policy=policy, dry_run=dry_run)
        return asyncio.run(fleet.scorer.score(request)).best

    for policy in ("round_robin", "random", "kv_aware"):
        asked = [best(policy, dry_run=True) for _ in range(4)]
        assert len(set(asked)) == 1, policy  # the same answer every time
        assert best(policy, dry_run=False) == asked[0], policy  # and the next real one
    assert sum(fleet.routed().values()) == 3  # the three real answers only


# --- top_k: answers that stay small ----------------------------------------------------------


class BigFleet:
    """``num`` single-stream replicas ``r0``…: ``r<i>`` holds ``i % 5`` of the request's
    blocks and reports a load that grows with ``i``; a scorer per ``default_top_k``."""

    def __init__(self, num: int, default_top_k: int = 16) -> None:
        specs = tuple(ReplicaSpec(f"r{i}", MODEL) for i in range(num))
        self.registry = Registry(specs, clock=lambda: NOW)
        self.index = MemoryIndex()
        self.loads = MemoryLoadStore()
        for i, spec in enumerate(specs):
            ops: list[Op] = [(OpKind.STORE, Tier.GPU, j, k) for j, k in enumerate(KEYS[: i % 5])]
            self.index.apply(StreamId(spec.id), 0, NOW, ops)
            self.registry.record(StreamId(spec.id), StreamReport(last_seq=0, last_event_ts=NOW))
            self.loads.put(spec.id, Load(float(i % 7), 0.0, 0.0, NOW, "push"))
        self.scorer = Scorer(
            ApiSettings(seed=3, default_top_k=default_top_k),
            self.index,
            self.registry,
            self.loads,
            tokenizers=lambda _: None,
            blocking_store=False,
            clock=lambda: NOW,
        )

    def answer(
        self,
        top_k: int | None = None,
        policy: str | None = None,
        weights: dict[str, float] | None = None,
    ) -> ScoreResponse:
        request = ScoreRequest(
            model=MODEL,
            token_ids=TOKENS,
            top_k=top_k,
            policy=policy,
            weights=weights,
            dry_run=True,  # the answers of one fleet do not weigh on each other
        )
        return asyncio.run(self.scorer.score(request))


def test_the_answer_explains_the_best_top_k_and_counts_the_rest() -> None:
    fleet = BigFleet(40)
    every = fleet.answer(top_k=0)
    top = fleet.answer(top_k=3)
    assert len(every.scores) == 40
    assert top.scores == every.scores[:3]  # the same entries, best first
    assert top.best == every.best == top.scores[0].replica
    assert (top.num_candidates, top.num_matched) == (40, 32)  # i % 5 != 0 for 32 of 40
    assert (every.num_candidates, every.num_matched) == (40, 32)


def test_the_default_top_k_is_the_settings_and_a_request_may_ask_for_more() -> None:
    assert len(BigFleet(40).answer().scores) == 16  # ApiSettings.default_top_k
    assert len(BigFleet(40, default_top_k=5).answer().scores) == 5
    assert len(BigFleet(40, default_top_k=5).answer(top_k=30).scores) == 30
    assert len(BigFleet(40, default_top_k=0).answer().scores) == 40
    assert len(BigFleet(4).answer(top_k=10).scores) == 4  # never more than the candidates


@pytest.mark.parametrize("policy", ["kv_aware", "least_load", "round_robin", "random"])
def test_best_is_the_same_whatever_top_k(policy: str) -> None:
    """Ties included (many replicas score alike) and with the seeded draws: each k is asked
    of a fresh scorer with the same seed, so any draw that depended on k would show."""
    bests = {BigFleet(40).answer(top_k=k, policy=policy).best for k in (0, 1, 2, 16, 39, 40)}
    assert len(bests) == 1


def test_a_softmax_draw_picks_the_same_best_whatever_top_k() -> None:
    weights = {"temperature": 0.5}
    answers = [BigFleet(40).answer(top_k=k, weights=weights) for k in (0, 1, 4)]
    assert len({a.best for a in answers}) == 1
    assert [len(a.scores) for a in answers] == [40, 1, 4]
    assert answers[2].scores[0].replica == answers[2].best


@pytest.mark.parametrize("policy", ["kv_aware", "least_load", "round_robin", "random"])
@pytest.mark.parametrize("top_k", [0, 1, 16])
def test_a_ranking_is_the_answers_order_and_matches(policy: str, top_k: int) -> None:
    """What the proxy reads (``Scorer.ranking``) is the answer's ``scores`` without the rest:
    two scorers of one seed, one asked for answers and one for rankings, in turn."""
    answers, rankings = BigFleet(40), BigFleet(40)
    for _ in range(3):
        request = ScoreRequest(model=MODEL, token_ids=TOKENS, top_k=top_k, policy=policy)
        answer = asyncio.run(answers.scorer.score(request))
        ranking = asyncio.run(rankings.scorer.ranking(request))
        assert ranking.num_tokens == answer.num_tokens
        assert ranking.ranked == tuple((e.replica, e.matched_tokens) for e in answer.scores)


def test_entries_are_built_for_the_returned_candidates_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost of the answer beyond scoring follows k, not the fleet: an entry, its load
    and freshness views are made for each returned candidate only."""
    built: list[str] = []

    def counted_entry(**fields: object) -> ScoreEntry:
        built.append(str(fields["replica"]))
        return ScoreEntry(**fields)  # type: ignore[arg-type]

    views: list[object] = []

    def counted_view(*args: object, **fields: object) -> FreshnessView:
        views.append(args)
        return FreshnessView(*args, **fields)  # type: ignore[arg-type]

    monkeypatch.setattr(answer_module, "ScoreEntry", counted_entry)
    monkeypatch.setattr(answer_module, "FreshnessView", counted_view)
    answer = BigFleet(200).answer(top_k=2)
    assert built == [e.replica for e in answer.scores] and len(built) == 2
    assert len(views) == 2


def test_during_a_load_store_outage_the_newest_of_read_and_pushed_loads_is_used() -> None:
    loads = _FlakyLoads()
    fleet = Fleet(loads)
    for replica in ("a", "b", "c"):
        fleet.loads.put(replica, Load(1.0, 0.0, 0.0, NOW - 5.0, "push"))
    fleet.answer()  # read: every load remembered
    fleet.scorer.note_load("b", Load(9.0, 0.0, 0.0, NOW - 1.0, "push"))  # pushed since
    fleet.scorer.note_load("c", Load(7.0, 0.0, 0.0, NOW - 9.0, "push"))  # older: ignored
    fleet.scorer.forget("a")
    loads.down = True
    entries = fleet.score()
    running = {r: e.load.running for r, e in entries.items() if e.load is not None}
    assert running == {"b": 9.0, "c": 1.0}


def test_block_keys_of_ids_handed_in_again_are_made_once_and_equal_the_plain_ones() -> None:
    memo = KeysMemo(max_keys=10)  # two entries of 4 keys (each counts one more)
    ids = [[i * 7 + n for i in range(64)] for n in range(3)]
    packed = [pack_ids(i) for i in ids]
    plain = ScoreRequest(model="m", block_keys=[])
    salted = ScoreRequest(model="m", block_keys=[], lora_name="l", cache_salt="s")
    first = memo.keys(plain, packed[0], 16)
    assert first == block_keys("m", ids[0], 16)
    assert memo.keys(plain, packed[0], 16) is first  # the same ids object: kept keys
    assert memo.keys(plain, pack_ids(ids[0]), 16) == first  # equal ids, another object
    assert memo.keys(salted, packed[0], 16) == block_keys(
        "m", ids[0], 16, lora_name="l", cache_salt="s"
    )
    assert memo.keys(plain, packed[0], 8) == block_keys("m", ids[0], 8)
    again = memo.keys(plain, packed[0], 16)
    assert again == first and again is not first  # replaced by the other inputs' keys
    memo.keys(plain, packed[1], 16)
    memo.keys(plain, packed[2], 16)  # past max_keys: the oldest entry goes
    assert memo.keys(plain, packed[2], 16) == block_keys("m", ids[2], 16)
    assert memo.keys(plain, packed[0], 16) is not again


def test_a_callers_packed_ids_are_not_remembered(fleet: Fleet) -> None:
    """The hot route's bytes are new each request: keeping them would hold memory for no
    hit (a 64-entry memo of 8,192-token queries is ~3 MiB)."""
    for _ in range(3):
        asyncio.run(fleet.scorer.score(ScoreRequest(model=MODEL), packed_tokens=pack_ids(TOKENS)))
    assert fleet.scorer._keys_memo._num_kept == 0
