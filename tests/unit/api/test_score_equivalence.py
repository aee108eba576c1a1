"""kvindex.api.score at fleet scale: the lean ``kv_aware`` path equals the straightforward one.

The scorer ranks ``kv_aware`` without building a candidate per replica (one load penalty
and one draw each, the cache term for the replicas that matched, the explained entries
for the ``top_k`` alone). The reference below is the plain read path: every candidate
built from every stream's freshness, every one scored and ranked by
:func:`kvindex.api.decision.policies.decide`. On random fleets (data-parallel ranks, stale and
replaying streams, CPU tiers, missing loads, identical idle loads that tie, requests in
flight, any ``top_k``), ``best``, every entry's score and terms, and the random generator
afterwards must be the same."""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision import fast_kv_aware as fast_module
from kvindex.api.decision import penalty_floors as floors_module
from kvindex.api.decision import policies as policies_module
from kvindex.api.decision import top_k as top_k_module
from kvindex.api.decision.policies import Candidate, Decision, LoadInput, Policy, Weights, decide
from kvindex.api.load.model import NO_IN_FLIGHT, Load
from kvindex.api.load.reservations import Reservations
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.lookup import matches as matches_module
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Freshness, Registry, StreamFreshness
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import HeldRuns, Op, OpKind, PrefixMatch
from tests.oracles import lookup as oracle

MODEL = "m"
NOW = 10_000.0


@pytest.fixture(autouse=True, params=[1, floors_module.MIN_CANDIDATES], ids=["floors", "plain"])
def _floors_from(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test twice: with penalty floors from one candidate on (these fleets are
    small), and as configured (below the threshold every penalty is computed)."""
    with patch.object(floors_module, "MIN_CANDIDATES", request.param):
        yield


BLOCK_SIZE = 16
TOKENS = list(range(1, 16 * BLOCK_SIZE + 1))
KEYS = block_keys(MODEL, TOKENS, BLOCK_SIZE)
_WORST = {Freshness.LIVE: 0, Freshness.REPLAYING: 1, Freshness.STALE: 2}


class RandomFleet:
    """A fleet drawn from ``seed``: its registry, index, loads and reservations."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.rng = rng
        num = rng.choice([1, 2, 5, 17, 40, 90])
        specs = tuple(
            ReplicaSpec(f"r{i}", MODEL, dp_size=rng.choice([1, 1, 1, 2])) for i in range(num)
        )
        self.specs = specs
        self.registry = Registry(specs, stale_after_s=30.0, clock=lambda: NOW)
        self.index = MemoryIndex()
        self.loads = MemoryLoadStore()
        self.reservations = Reservations(self.loads.ledger, 60.0, holder="proxy")
        self.idle = Load(0.0, 0.0, 0.0, NOW - 1.0, "push")
        for spec in specs:
            self._fill(spec)
        self.weights = Weights(load_half_life_s=rng.choice([0.0, 10.0]))

    def _fill(self, spec: ReplicaSpec) -> None:
        rng = self.rng
        for rank in range(spec.dp_size):
            stream = StreamId(spec.id, rank)
            if rng.random() < 0.1:
                continue  # never heard of
            num_blocks = rng.choice([0, 0, 0, 1, 4, 8, 16])
            tier = rng.choice([Tier.GPU, Tier.GPU, Tier.CPU])
            ops: list[Op] = [(OpKind.STORE, tier, i, k) for i, k in enumerate(KEYS[:num_blocks])]
            if ops:
                self.index.apply(stream, 0, NOW, ops)
            heard = NOW - rng.choice([0.5, 2.0, 100.0])  # the last one is stale
            self.registry.record(stream, StreamReport(last_seq=0, last_event_ts=heard))
            if rng.random() < 0.1:
                self.registry.record(stream, StreamReport(replaying=True))
        kind = rng.random()
        if kind < 0.4:
            self.loads.put(spec.id, self.idle)  # identical loads: ties
        elif kind < 0.85:
            running, waiting = float(rng.randint(0, 8)), float(rng.randint(0, 3))
            ts = NOW - rng.choice([0.0, 3.0, 30.0, -5.0])  # the last one from the future
            self.loads.put(spec.id, Load(running, waiting, rng.random(), ts, "push"))
        if rng.random() < 0.15:
            self.reservations.reserve(spec.id, rng.choice([0, 500]))

    def scorer(
        self,
        seed: int,
        clock: Callable[[], float] = lambda: NOW,
        distrusted: frozenset[str] = frozenset(),
    ) -> Scorer:
        settings = ApiSettings(seed=seed, weights=self.weights)
        return Scorer(
            settings,
            self.index,
            self.registry,
            self.loads,
            tokenizers=lambda _: None,
            blocking_store=False,
            clock=clock,
            distrusted=lambda: distrusted,
        )


def reference(
    fleet: RandomFleet,
    top_k: int | None,
    rng: random.Random,
    *,
    now: float = NOW,
    weights: Weights | None = None,
    distrusted: frozenset[str] = frozenset(),
) -> Decision:
    """The plain read path: every candidate built, scored and ranked (loads aged as of
    ``now``; ``weights``: the fleet's unless given)."""
    replicas = [s.id for s in fleet.registry.replicas()]
    streams = sorted(
        {StreamId(s.id, r) for s in fleet.specs for r in range(s.dp_size)}
        | set(fleet.registry.stream_ids())
    )
    found = fleet.index.longest_prefix(KEYS, streams)
    best: dict[str, tuple[Tier, ...]] = {}
    for stream, match in found.items():
        if len(match.tiers) > len(best.get(stream.replica, ())):
            best[stream.replica] = match.tiers
    statuses: dict[str, list[StreamFreshness]] = {}
    for status in fleet.registry.freshness():
        statuses.setdefault(status.stream.replica, []).append(status)
    loads = fleet.loads.get_counted(replicas)
    cands = []
    for replica in replicas:
        states = [s.freshness for s in statuses.get(replica, [])] or [Freshness.STALE]
        state = max(states, key=_WORST.__getitem__)
        counted = loads.get(replica)
        load, routed, in_flight = counted if counted is not None else (None, 0, NO_IN_FLIGHT)
        load_input = None
        if load is not None:
            age = max(0.0, now - load.ts)
            load_input = LoadInput(load.running, load.waiting, load.kv_usage, age, routed)
        flying = (float(in_flight.num_requests), float(in_flight.num_tokens))
        cands.append(Candidate(replica, best.get(replica, ()), state, load_input, *flying))
    return decide(
        Policy.KV_AWARE,
        cands,
        KEYS,
        weights or fleet.weights,
        session=None,
        turns=itertools.count(),
        rng=rng,
        top_k=top_k,
        distrusted=distrusted,
    )


def answer(
    scorer: Scorer,
    top_k: int | None,
    dry_run: bool = False,
    weights: dict[str, float] | None = None,
) -> ScoreResponse:
    request = ScoreRequest(
        model=MODEL, token_ids=TOKENS, top_k=top_k, dry_run=dry_run, weights=weights
    )
    return asyncio.run(scorer.score(request))


@pytest.mark.parametrize("seed", range(60))
def test_the_lean_kv_aware_answer_equals_the_plain_one_on_random_fleets(seed: int) -> None:
    fleet = RandomFleet(seed)
    top_k = random.Random(seed).choice([None, 1, 2, 3, 10, 1_000])
    scorer = fleet.scorer(seed)
    got = answer(scorer, 0 if top_k is None else top_k, dry_run=True)
    expected = reference(fleet, top_k, random.Random(seed))
    assert got.best == expected.best
    assert [(e.replica, e.score, e.terms) for e in got.scores] == [
        (s.replica, s.score, s.terms) for s in expected.ranked
    ]
    assert got.num_candidates == len(fleet.specs)


@pytest.mark.parametrize("seed", range(30))
def test_a_distrusted_replicas_discount_is_the_same_term_on_both_paths(seed: int) -> None:
    """The proxy's over-predicted replicas: their cache term times ``over_predicted_factor``,
    explained as ``prediction_factor``, alike on the lean path and the plain one."""
    fleet = RandomFleet(seed)
    distrusted = frozenset(s.id for s in fleet.specs[::2])
    top_k = random.Random(seed).choice([None, 1, 3, 1_000])
    got = answer(fleet.scorer(seed, distrusted=distrusted), 0 if top_k is None else top_k, True)
    expected = reference(fleet, top_k, random.Random(seed), distrusted=distrusted)
    assert [(e.replica, e.score, e.terms) for e in got.scores] == [
        (s.replica, s.score, s.terms) for s in expected.ranked
    ]
    for entry in got.scores:
        factor = entry.terms.get("prediction_factor")
        assert factor == (
            fleet.weights.over_predicted_factor if entry.replica in distrusted else None
        )


@pytest.mark.parametrize("seed", range(40))
def test_holders_whose_freshness_is_not_read_change_nothing(seed: int) -> None:
    """A small ``top_k``: only the holders that may rank whatever their freshness have it
    read; freshness factors above 1, a heavy cache weight and a CPU tier worth more than
    the GPU's stretch that bound (answers equal the plain path's)."""
    fleet = RandomFleet(seed)
    rng = random.Random(seed)
    fleet.weights = Weights(
        cache=rng.choice([1.0, 4.0]),
        cpu=rng.choice([0.8, 1.2]),
        stale_factor=rng.choice([0.5, 1.5]),
        replaying_factor=rng.choice([0.8, 2.0]),
    )
    top_k = rng.choice([1, 2, 3])
    got = answer(fleet.scorer(seed), top_k, dry_run=True)
    expected = reference(fleet, top_k, random.Random(seed))
    assert got.best == expected.best
    assert [(e.replica, e.score, e.terms) for e in got.scores] == [
        (s.replica, s.score, s.terms) for s in expected.ranked
    ]


def test_a_stale_holder_worth_more_than_live_still_wins() -> None:
    """``stale_factor`` 1.5: the one holder (2 of 16 blocks, stale) scores 0.1875 - 0.25,
    above the idlest non-holder's -0.1, though its credit at factor 1 would not be: the
    bound on what a holder may gain takes the largest factor."""
    specs = (ReplicaSpec("a", MODEL), ReplicaSpec("b", MODEL), ReplicaSpec("c", MODEL))
    clock = [NOW - 100.0]  # a is heard of 100 s ago (stale), b and c now
    registry = Registry(specs, stale_after_s=30.0, clock=lambda: clock[0])
    index, loads = MemoryIndex(), MemoryLoadStore()
    index.apply(StreamId("a"), 0, NOW, [(OpKind.STORE, Tier.GPU, i, KEYS[i]) for i in range(2)])
    for spec, (waiting, kv_usage) in zip(specs, ((0.5, 1.0), (0.0, 0.5), (0.0, 1.0)), strict=True):
        registry.record(StreamId(spec.id), StreamReport(last_seq=0, last_event_ts=clock[0]))
        loads.put(spec.id, Load(0.0, waiting, kv_usage, NOW, "push"))
        clock[0] = NOW
    weights = Weights(stale_factor=1.5)
    scorer = Scorer(
        ApiSettings(seed=1, weights=weights),
        index,
        registry,
        loads,
        tokenizers=lambda _: None,
        blocking_store=False,
        clock=lambda: NOW,
    )
    got = answer(scorer, 1, dry_run=True)
    assert got.best == "a"
    (entry,) = got.scores
    assert (entry.freshness.state, entry.terms["freshness_factor"]) == ("stale", 1.5)
    assert entry.score == pytest.approx(2 / 16 * 1.5 - 0.25)


def _oracle_contenders(
    runs: HeldRuns,
    position_of: list[int],
    replica_of: list[str],
    matches: dict[str, PrefixMatch],
    penalties: list[float],
    per_block: float,
    threshold: float,
) -> dict[str, PrefixMatch]:
    return oracle.contenders(
        runs,
        position_of,
        replica_of,
        matches=matches,
        penalties=penalties,
        per_block=per_block,
        threshold=threshold,
    )


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_the_oracles_answer_as_the_compiled_loops(seed: int) -> None:
    """With the compiled read-path loops replaced by their Python references (penalties,
    draws, the k-th penalty, the holders' best matches and contenders), the same answers."""
    fleet = RandomFleet(seed)
    top_k = random.Random(seed).choice([1, 2, 3, 10])
    compiled = answer(fleet.scorer(seed), top_k, dry_run=True)
    with ExitStack() as stack:
        for module, name, reference in (
            (top_k_module, "_best_tied", policies_module.tie_order),
            (top_k_module, "_kth_smallest", lambda values, k: sorted(values)[k - 1]),
            (top_k_module, "_contenders", _oracle_contenders),
            (fast_module, "load_penalties", oracle.load_penalties),
            (matches_module, "_best_matches", oracle.best_matches),
        ):
            stack.enter_context(patch.object(module, name, reference))
        python = answer(fleet.scorer(seed), top_k, dry_run=True)
    assert [(e.replica, e.score, e.terms) for e in python.scores] == [
        (e.replica, e.score, e.terms) for e in compiled.scores
    ]
    assert python.best == compiled.best


@pytest.mark.parametrize("seed", range(10))
def test_the_lean_path_draws_what_the_plain_one_draws(seed: int) -> None:
    """One draw per candidate, tie or not: the answers after a real one are the same too
    (the real one counted as load on both sides)."""
    fleet = RandomFleet(seed)
    scorer = fleet.scorer(seed)
    rng = random.Random(seed)
    for _ in range(3):
        got = answer(scorer, 2)  # counts the answer before it, as the reference then reads
        expected = reference(fleet, 2, rng)
        assert got.best == expected.best
        assert [e.score for e in got.scores] == [s.score for s in expected.ranked]
    answer(scorer, 2, dry_run=True)  # counts the last answer in the store, draws on a copy
    assert answer(scorer, 2, dry_run=True).best == reference(fleet, 2, rng).best


@pytest.mark.parametrize("num_replicas", [50, 300, 1_500])
def test_an_idle_fleet_ties_everywhere_and_the_draws_decide(num_replicas: int) -> None:
    """Every replica idle and unmatched: scores and loads tie, the draws order them; a real
    answer moves the generator by one draw per candidate."""
    specs = tuple(ReplicaSpec(f"r{i}", MODEL) for i in range(num_replicas))
    registry = Registry(specs, clock=lambda: NOW)
    loads = MemoryLoadStore()
    for spec in specs:
        registry.record(StreamId(spec.id), StreamReport(last_seq=0, last_event_ts=NOW))
        loads.put(spec.id, Load(0.0, 0.0, 0.0, NOW, "push"))
    scorer = Scorer(
        ApiSettings(seed=3),
        MemoryIndex(),
        registry,
        loads,
        tokenizers=lambda _: None,
        blocking_store=False,
        clock=lambda: NOW,
    )
    got = answer(scorer, 5, dry_run=True)
    rng = random.Random(3)
    ids = sorted(s.id for s in specs)  # the candidates' order, one draw each
    draw = dict(zip(ids, [rng.random() for _ in ids], strict=True))
    assert [e.replica for e in got.scores] == sorted(ids, key=draw.__getitem__)[:5]
    assert {e.score for e in got.scores} == {0.0}
    answer(scorer, 5)  # a real answer: the scorer's generator moves as the reference's
    assert scorer._rng.getstate() == rng.getstate()


_STEPS = st.sampled_from(["answer", "dry_run", "put", "reserve", "release", "tick", "weights"])


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.sampled_from([1, 2, 3, 5, 16]),
    steps=st.lists(st.tuples(_STEPS, st.integers(0, 2**32)), min_size=1, max_size=10),
)
def test_kept_penalty_floors_and_one_call_draws_answer_as_the_plain_path(
    seed: int, top_k: int, steps: list[tuple[str, int]]
) -> None:
    """Answers one after another while loads change (puts, answers counted, requests in
    flight coming and going), the clock moves (within a floor's window and past it) and
    requests change the weights: each answer's ``best`` and entries are the plain path's,
    and the generator moves as the plain path's (real answers draw from both)."""
    fleet = RandomFleet(seed)
    busy = random.Random(-seed)
    for spec in fleet.specs:  # fewer idle ties than RandomFleet's: a change must be seen
        if busy.random() < 0.95:
            numbers = (float(busy.randint(0, 8)), float(busy.randint(0, 3)), busy.random())
            fleet.loads.remove(spec.id)
            fleet.loads.put(spec.id, Load(*numbers, NOW - busy.choice([0.0, 1.0, 3.0]), "push"))
    clock = [NOW]
    scorer = fleet.scorer(seed, lambda: clock[0])
    rng = random.Random(seed)
    leases = []
    for kind, x in steps:
        pick = random.Random(x)
        replica = pick.choice(fleet.specs).id
        weights: dict[str, float] | None = None
        if kind == "put":
            numbers = (float(pick.randint(0, 8)), float(pick.randint(0, 3)), pick.random())
            numbers = pick.choice([numbers, (0.0, 0.0, 0.0)])  # idle: it may now rank first
            fleet.loads.put(replica, Load(*numbers, clock[0] - pick.choice([0.0, 2.0]), "push"))
        elif kind == "reserve":
            leases.append(fleet.reservations.reserve(replica, pick.choice([0, 500])))
        elif kind == "release" and leases:
            fleet.reservations.release(leases.pop(pick.randrange(len(leases))))
        elif kind == "tick":
            clock[0] += pick.choice([0.001, 0.05, 0.5, 20.0])
        elif kind == "weights":
            weights = {"waiting": pick.choice([0.0, 0.1, 1.0]), "kv_usage": pick.random()}
        dry_run = kind == "dry_run"
        got = answer(scorer, top_k, dry_run=dry_run, weights=weights)
        w = fleet.weights.overridden(weights)
        expected = reference(
            fleet, top_k, copy.copy(rng) if dry_run else rng, now=clock[0], weights=w
        )
        assert got.best == expected.best
        assert [(e.replica, e.score, e.terms) for e in got.scores] == [
            (s.replica, s.score, s.terms) for s in expected.ranked
        ]
    assert scorer._rng.getstate() == rng.getstate()
