"""The replicas that tokenize a model: the reference and those that agree with it in turn, the
unvetted after them, one that differs never; vetted in the background, again when due."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

import pytest

from kvindex.api.tokenize.renderers import ProbeAnswer, Renderers, Replica

MODEL = "m"
SAME: ProbeAnswer = ((1, 2, 3), (4, 5))
OTHER: ProbeAnswer = ((1, 2, 9), (4, 5))
FAILED: ProbeAnswer = (None, None)


def _replicas(n: int) -> list[Replica]:
    return [(f"r{i}", f"http://r{i}:8000") for i in range(1, n + 1)]


class Fleet:
    """Each replica's probe answer (``SAME`` unless set), the probes asked, and a clock."""

    def __init__(self) -> None:
        self.answers: dict[str, ProbeAnswer] = {}
        self.probed: list[str] = []
        self.now = 0.0
        self.hold: asyncio.Event | None = None

    async def probe(self, url: str) -> ProbeAnswer:
        replica = url.split("//")[1].split(":", maxsplit=1)[0]
        self.probed.append(replica)
        if self.hold is not None:
            await self.hold.wait()
        return self.answers.get(replica, SAME)

    def renderers(self) -> Renderers:
        return Renderers(MODEL, self.probe, clock=lambda: self.now, recheck_s=300, retry_s=10)


async def _until(done: Callable[[], bool]) -> None:
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("not settled")


async def _vetted(renderers: Renderers, replicas: list[Replica]) -> None:
    """One call (which starts a round when due), then the round's end."""
    renderers.order(replicas, 1)
    await _until(lambda: renderers._round is None)


async def _started(n: int, **answers: ProbeAnswer) -> tuple[Fleet, Renderers, list[Replica]]:
    """``n`` replicas (``answers``: the probe answers that are not ``SAME``), r1 the
    reference, the first round over."""
    fleet, replicas = Fleet(), _replicas(n)
    fleet.answers.update(answers)
    renderers = fleet.renderers()
    renderers.answered(replicas[0])
    await _vetted(renderers, replicas)
    return fleet, renderers, replicas


def _firsts(renderers: Renderers, replicas: list[Replica], n: int) -> Counter[str]:
    return Counter(renderers.order(replicas, 1)[0][0] for _ in range(n))


def test_before_any_answer_the_replicas_are_asked_in_registry_order() -> None:
    async def run() -> None:
        fleet, replicas = Fleet(), _replicas(4)
        renderers = fleet.renderers()
        assert renderers.order(replicas, 3) == replicas[:3]
        assert renderers.order(replicas, 3) == replicas[:3]
        await asyncio.sleep(0)
        assert fleet.probed == []  # nothing to vet against before a reference

    asyncio.run(run())


def test_the_replicas_that_agree_with_the_reference_are_asked_in_turn() -> None:
    async def run() -> None:
        fleet, replicas = Fleet(), _replicas(4)
        renderers = fleet.renderers()
        renderers.answered(replicas[1])
        await _vetted(renderers, replicas)
        assert fleet.probed == ["r2", "r1", "r3", "r4"]  # the reference first
        assert renderers.verdicts() == {"agrees": 4, "differs": 0, "unvetted": 0}
        assert _firsts(renderers, replicas, 8) == {"r1": 2, "r2": 2, "r3": 2, "r4": 2}
        assert len(renderers.order(replicas, 3)) == 3  # the next ones to fail over to

    asyncio.run(run())


def test_a_replica_that_differs_is_never_asked_and_a_warning_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        _fleet, renderers, replicas = await _started(3, r3=OTHER)
        assert renderers.verdicts() == {"agrees": 2, "differs": 1, "unvetted": 0}
        assert _firsts(renderers, replicas, 6) == {"r1": 3, "r2": 3}
        assert all(replicas[2] not in renderers.order(replicas, 3) for _ in range(3))

    with caplog.at_level(logging.WARNING, "kvindex.tokenize"):
        asyncio.run(run())
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "replica r3 tokenizes the probe differently from replica r1" in warning


def test_a_replica_whose_probe_failed_is_asked_after_those_that_agree_and_vetted_again() -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(3, r2=FAILED)
        assert renderers.verdicts() == {"agrees": 2, "differs": 0, "unvetted": 1}
        assert renderers.order(replicas, 3)[-1] == replicas[1]
        fleet.now = 9.0
        await _vetted(renderers, replicas)
        assert fleet.probed.count("r2") == 1  # not before retry_s
        del fleet.answers["r2"]
        fleet.now = 10.0
        await _vetted(renderers, replicas)
        assert fleet.probed.count("r2") == 2
        assert renderers.verdicts()["agrees"] == 3

    asyncio.run(run())


def test_a_chat_the_reference_cannot_render_is_left_out_of_the_comparison() -> None:
    async def run() -> None:
        _, renderers, _ = await _started(2, r1=(SAME[0], None))
        assert renderers.verdicts()["agrees"] == 2

    asyncio.run(run())


def test_a_reference_gone_is_followed_by_one_that_agrees_without_vetting_again() -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(3)
        num_probed = len(fleet.probed)
        rest = replicas[1:]
        await _vetted(renderers, rest)
        assert len(fleet.probed) == num_probed
        assert renderers.verdicts() == {"agrees": 2, "differs": 0, "unvetted": 0}
        assert set(_firsts(renderers, rest, 4)) == {"r2", "r3"}

    asyncio.run(run())


def test_a_reference_gone_with_none_agreeing_makes_the_next_to_answer_the_reference() -> None:
    async def run() -> None:
        _fleet, renderers, replicas = await _started(3, r2=OTHER, r3=OTHER)
        assert renderers.verdicts()["differs"] == 2
        rest = replicas[1:]
        assert renderers.order(rest, 3) == rest  # all unvetted again, no reference
        renderers.answered(replicas[2])
        await _vetted(renderers, rest)
        assert renderers.verdicts() == {"agrees": 2, "differs": 0, "unvetted": 0}

    asyncio.run(run())


def test_a_verdict_is_vetted_again_once_due() -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(2)
        fleet.answers["r2"] = OTHER  # redeployed with another tokenizer
        fleet.now = 299.0
        await _vetted(renderers, replicas)
        assert renderers.verdicts()["agrees"] == 2
        fleet.now = 300.0
        await _vetted(renderers, replicas)
        assert renderers.verdicts() == {"agrees": 1, "differs": 1, "unvetted": 0}

    asyncio.run(run())


def test_a_reference_that_changed_its_ids_has_every_replica_vetted_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(3)
        fleet.answers["r1"] = fleet.answers["r2"] = OTHER  # r1 and r2 redeployed; r3 not yet
        fleet.now = 300.0
        await _vetted(renderers, replicas)
        assert renderers.verdicts() == {"agrees": 2, "differs": 1, "unvetted": 0}
        assert _firsts(renderers, replicas, 4) == {"r1": 2, "r2": 2}

    with caplog.at_level(logging.WARNING, "kvindex.tokenize"):
        asyncio.run(run())
    assert any("r1 (the reference) now tokenizes" in r.getMessage() for r in caplog.records)


def test_a_new_replica_is_vetted_at_once() -> None:
    async def run() -> None:
        fleet, renderers, _ = await _started(2)
        more = _replicas(3)
        await _vetted(renderers, more)
        assert fleet.probed[-1] == "r3"
        assert renderers.verdicts()["agrees"] == 3

    asyncio.run(run())


def test_answers_are_counted_by_replica() -> None:
    async def run() -> None:
        renderers = Fleet().renderers()
        replicas = _replicas(2)
        for replica in (replicas[0], replicas[1], replicas[1]):
            renderers.answered(replica)
        assert renderers.num_answers == {"r1": 1, "r2": 2}
        await renderers.aclose()

    asyncio.run(run())


def test_aclose_stops_a_round_in_flight() -> None:
    async def run() -> None:
        fleet, replicas = Fleet(), _replicas(2)
        fleet.hold = asyncio.Event()
        renderers = fleet.renderers()
        renderers.answered(replicas[0])
        renderers.order(replicas, 1)
        await _until(lambda: fleet.probed == ["r1"])
        round_ = renderers._round
        assert round_ is not None
        await renderers.aclose()
        assert round_.cancelled() and renderers._round is None

    asyncio.run(run())


def test_a_replica_that_fails_a_call_is_asked_last_until_a_probe_of_it_answers() -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(3)
        renderers.failed(replicas[1])
        assert renderers.verdicts() == {"agrees": 2, "differs": 0, "unvetted": 1}
        assert renderers.order(replicas, 3)[-1] == replicas[1]
        assert set(_firsts(renderers, replicas, 4)) == {"r1", "r3"}
        fleet.now = 10.0
        await _vetted(renderers, replicas)
        assert renderers.verdicts()["agrees"] == 3

    asyncio.run(run())


def test_a_replica_that_keeps_failing_is_probed_ever_less_often() -> None:
    async def run() -> list[float]:
        fleet, renderers, replicas = await _started(2, r2=FAILED)
        probed_at = []
        for now in range(0, 100):
            fleet.now = float(now)
            before = fleet.probed.count("r2")
            await _vetted(renderers, replicas)
            if fleet.probed.count("r2") > before:
                probed_at.append(fleet.now)
        return probed_at

    assert asyncio.run(run()) == [10.0, 30.0, 70.0]  # 10 s, then 20, then 40


def test_a_reference_that_fails_stays_the_reference_while_the_others_agree() -> None:
    async def run() -> None:
        fleet, renderers, replicas = await _started(3)
        renderers.failed(replicas[0])
        assert set(_firsts(renderers, replicas, 4)) == {"r2", "r3"}
        fleet.answers["r4"] = SAME
        more = _replicas(4)
        await _vetted(renderers, more)  # vetted against the reference's answer, kept
        assert renderers.verdicts() == {"agrees": 3, "differs": 0, "unvetted": 1}
        fleet.now = 10.0
        await _vetted(renderers, more)
        assert renderers.verdicts()["agrees"] == 4

    asyncio.run(run())


def test_the_avoided_are_asked_after_every_other_replica() -> None:
    async def run() -> None:
        _, renderers, replicas = await _started(4)
        renderers.failed(replicas[3])  # r4 unvetted: still before the avoided
        for _ in range(4):
            order = renderers.order(replicas, 4, avoid={"r2"})
            assert order[-2:] == [replicas[3], replicas[1]]
            assert set(order[:2]) == {replicas[0], replicas[2]}
        before = renderers.order([replicas[1], replicas[0]], 2, avoid={"r2"})
        assert before[-1] == replicas[1]

    asyncio.run(run())
