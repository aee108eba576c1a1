"""kvindex.api.score: unhealthy candidates (ejected, events down) are left out of the
ranking while another one is healthy; when none is, every one is ranked and the answer says
why it is degraded."""

from __future__ import annotations

import asyncio

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import health_policy
from kvindex.api.load.model import Load
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import ReplicaHealth
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind
from tests.support.clock import Clock

MODEL = "m"
TOKENS = list(range(1, 65))
KEYS = block_keys(MODEL, TOKENS, 16)
SETTINGS = ApiSettings(seed=1, unhealthy_threshold=1, events_down_after_s=2.0)


class Fleet:
    """``hot`` holds the whole prompt and has no load; ``cold`` and ``bind`` hold nothing
    and are busy: ``hot`` wins whenever it is ranked. ``hot`` and ``cold`` are connect-mode
    (their events stream is connected); ``bind`` publishes to a bound SUB."""

    def __init__(self) -> None:
        self.clock = Clock()
        specs = (
            ReplicaSpec("hot", MODEL, events="tcp://127.0.0.1:5557"),
            ReplicaSpec("cold", MODEL, events="tcp://127.0.0.1:5567"),
            ReplicaSpec("bind", MODEL),
        )
        self.registry = Registry(specs, clock=self.clock)
        index = MemoryIndex()
        ops: list[Op] = [(OpKind.STORE, Tier.GPU, i, k) for i, k in enumerate(KEYS)]
        index.apply(StreamId("hot"), 0, self.clock.now, ops)
        loads = MemoryLoadStore()
        for replica in ("cold", "bind"):
            loads.put(replica, Load(4, 4, 0.5, self.clock.now, "push"))
        for replica in ("hot", "cold"):
            self.registry.record(StreamId(replica), StreamReport(connected=True))
        self.registry.record(StreamId("bind"), StreamReport(last_seq=0, last_event_ts=1.0))
        self.scorer = Scorer(
            SETTINGS,
            index,
            self.registry,
            loads,
            tokenizers=lambda _: None,
            blocking_store=False,
            clock=self.clock,
        )

    def answer(self, **fields: object) -> ScoreResponse:
        request = ScoreRequest(model=MODEL, token_ids=TOKENS, **fields)  # type: ignore[arg-type]
        return asyncio.run(self.scorer.score(request))

    def fail_check(self, replica: str) -> None:
        now = self.clock.now
        policy = health_policy(SETTINGS)
        self.registry.update_health({replica: lambda h: h.after_check(False, "boom", now, policy)})


def _ranked(answer: ScoreResponse) -> list[str]:
    return [e.replica for e in answer.scores]


def test_a_healthy_fleet_is_ranked_whole() -> None:
    answer = Fleet().answer()
    assert answer.best == "hot" and answer.unhealthy == {} and answer.degraded is None
    assert answer.num_candidates == 3


def test_an_ejected_replica_is_never_best_nor_ranked() -> None:
    fleet = Fleet()
    fleet.fail_check("hot")
    answer = fleet.answer()
    assert answer.best != "hot" and "hot" not in _ranked(answer)
    assert answer.unhealthy == {"hot": "ejected: 1 failed health checks (boom)"}
    assert answer.degraded is None and answer.num_candidates == 2


def test_an_open_breaker_ejects_until_its_cooldown_ends() -> None:
    fleet = Fleet()
    policy = health_policy(SETTINGS)
    now = fleet.clock.now
    fleet.registry.update_health({"hot": lambda h: h.breaker_opened(now, policy, "status 502")})
    assert fleet.answer().best != "hot"
    fleet.clock.now += SETTINGS.breaker_cooldown_s
    assert fleet.answer().best == "hot"  # half-open: it takes requests again


def test_events_disconnected_and_silent_past_the_grace_leave_it_out() -> None:
    fleet = Fleet()
    fleet.registry.record(StreamId("hot"), StreamReport(connected=False))
    fleet.clock.now += 1.9
    assert fleet.answer().best == "hot"  # a blip: not yet
    fleet.clock.now += 0.2
    answer = fleet.answer()
    assert answer.best != "hot"
    assert answer.unhealthy == {"hot": "events stream disconnected 2.1s"}


def test_a_connect_mode_replica_never_connected_is_left_out_at_once() -> None:
    fleet = Fleet()
    fleet.registry.add(ReplicaSpec("dead", MODEL, events="tcp://127.0.0.1:5599"))
    fleet.registry.record(StreamId("dead"), StreamReport())  # as the pipeline does at add
    answer = fleet.answer()
    assert answer.unhealthy == {"dead": "events stream never connected"}
    assert "dead" not in _ranked(answer)


def test_bind_mode_and_unknown_streams_are_not_judged_by_their_connection() -> None:
    fleet = Fleet()
    fleet.registry.add(ReplicaSpec("new", MODEL, events="tcp://127.0.0.1:5598"))  # no record
    answer = fleet.answer()
    assert answer.unhealthy == {} and len(answer.scores) == 4


def test_every_candidate_unhealthy_ranks_them_all_and_says_why() -> None:
    fleet = Fleet()
    for replica in ("hot", "cold", "bind"):
        fleet.fail_check(replica)
    answer = fleet.answer()
    assert answer.best == "hot" and sorted(_ranked(answer)) == ["bind", "cold", "hot"]
    assert set(answer.unhealthy) == {"hot", "cold", "bind"}
    assert answer.degraded is not None
    assert answer.degraded.startswith("no healthy candidate, every one ranked (bind: ejected")


def test_candidates_given_by_the_request_are_judged_alike() -> None:
    fleet = Fleet()
    fleet.fail_check("hot")
    answer = fleet.answer(candidates=["hot", "cold"])
    assert answer.best == "cold" and list(answer.unhealthy) == ["hot"]
    alone = fleet.answer(candidates=["hot"])
    assert alone.best == "hot" and alone.degraded is not None


def test_degraded_answers_report_the_reason() -> None:
    fleet = Fleet()
    reasons: list[str] = []
    fleet.scorer = Scorer(
        SETTINGS,
        MemoryIndex(),
        fleet.registry,
        MemoryLoadStore(),
        tokenizers=lambda _: None,
        blocking_store=False,
        clock=fleet.clock,
        on_degraded=reasons.append,
    )
    for replica in ("hot", "cold", "bind"):
        fleet.fail_check(replica)
    fleet.answer()
    assert reasons == ["no_healthy_candidate"]


def test_records_of_unjudged_replicas_default_to_healthy() -> None:
    assert ReplicaHealth().ejection(0.0, health_policy(SETTINGS)) is None
