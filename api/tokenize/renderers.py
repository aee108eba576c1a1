"""Which replicas tokenize a model: the reference (the first to answer) and those whose ids for
a fixed probe equal its own, in turn; the unvetted (vetted in the background) and those that
failed a call after them; one that differs never (a warning names it). Each is vetted again
:data:`RECHECK_S` after its last vetting. One event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

RECHECK_S = 300.0
"""How long a verdict holds before the replica is vetted again (a redeploy may change it)."""
RETRY_S = 10.0  # a failed replica's first wait before its next probe
VETTING_AT_ONCE = 8

PROBE_PROMPT = "kvindex probe: Ünïcödé, 数字 12345 and <tags>\n\ttabs… 🦊 done."
PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are the kvindex tokenizer probe."},
    {"role": "user", "content": "Ünïcödé, 数字 12345 🦊?"},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Again, with <tags>\n\ttabs."},
]
"""What every replica renders to be vetted: a completions prompt and a chat (its template)."""

Verdict = Literal["agrees", "differs", "unvetted"]
Ids = tuple[int, ...]
ProbeAnswer = tuple[Ids | None, Ids | None]
"""A replica's ids for :data:`PROBE_PROMPT` and :data:`PROBE_MESSAGES` (None: that call failed)."""
Probe = Callable[[str], Awaitable[ProbeAnswer]]
Replica = tuple[str, str]  # (id, url)

logger = logging.getLogger("kvindex.tokenize")


@dataclass(slots=True)
class _Vetting:
    verdict: Verdict
    due: float  # when (clock) it is vetted next
    num_failures: int = 0  # in a row: each doubles the wait, up to recheck_s


class Renderers:
    """One model's tokenizing replicas; ``probe`` answers for one URL and never raises."""

    def __init__(
        self,
        model: str,
        probe: Probe,
        *,
        clock: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.model = model
        self._probe = probe
        self._clock = clock
        self._recheck_s = recheck_s
        self._retry_s = retry_s
        self._reference: Replica | None = None
        self._expected: ProbeAnswer | None = None  # the reference's answer: what agreeing is
        self._vettings: dict[str, _Vetting] = {}
        self._generation = 0  # moves on with the reference: a round's late results dropped
        self._turn = 0
        self._next_round = 0.0
        self._round: asyncio.Task[None] | None = None
        self._followed: Sequence[Replica] | None = None
        self._agreeing: list[Replica] | None = None
        self.num_answers: Counter[str] = Counter()  # calls answered, by replica still here

    def order(
        self, replicas: Sequence[Replica], limit: int, avoid: Collection[str] = ()
    ) -> list[Replica]:
        """Up to ``limit`` of ``replicas`` (registry order; the same object while unchanged)
        to ask: those that agree from this turn on, then the unvetted, the ids in ``avoid``
        last; none that differs. Starts a vetting round when one is due."""
        if replicas is not self._followed:
            self._follow(replicas)
        self._maybe_vet(replicas)
        if self._reference is None:
            return _first(lambda: iter(replicas), limit, avoid)
        agreeing = self._agreeing_of(replicas)
        self._turn += 1
        turn, num_agreeing = self._turn, len(agreeing)

        def candidates() -> Iterator[Replica]:  # walked only as far as the answer needs
            yield from (agreeing[(turn + i) % num_agreeing] for i in range(num_agreeing))
            yield from (r for r in replicas if self._verdict(r[1]) == "unvetted")

        return _first(candidates, limit, avoid)

    def answered(self, replica: Replica) -> None:
        """``replica`` answered a request: counted; the reference if there was none."""
        self.num_answers[replica[0]] += 1
        if self._reference is None:
            self._reference = replica
            self._vettings = {replica[1]: _Vetting("agrees", self._clock())}
            self._agreeing = None
            self._next_round = 0.0
            self._maybe_vet(self._followed or [replica])

    def failed(self, replica: Replica) -> None:
        """``replica`` failed a request: out of the turns until a probe of it answers."""
        self._failing(replica[1], "unvetted")
        self._next_round = min(self._next_round, self._vettings[replica[1]].due)

    def verdicts(self) -> Counter[Verdict]:
        """How many of the replicas last ordered are in each state."""
        counts: Counter[Verdict] = Counter({"agrees": 0, "differs": 0, "unvetted": 0})
        for _, url in self._followed or ():
            counts[self._verdict(url)] += 1
        return counts

    async def aclose(self) -> None:
        task, self._round = self._round, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _verdict(self, url: str) -> Verdict:
        vetting = self._vettings.get(url)
        return "unvetted" if vetting is None else vetting.verdict

    def _agreeing_of(self, replicas: Sequence[Replica]) -> list[Replica]:
        if self._agreeing is None:
            self._agreeing = [r for r in replicas if self._verdict(r[1]) == "agrees"]
        return self._agreeing

    def _follow(self, replicas: Sequence[Replica]) -> None:
        """A reference gone is followed by one that agreed, else by the next to answer."""
        self._followed, self._agreeing = replicas, None
        urls = {url for _, url in replicas}
        self._vettings = {u: v for u, v in self._vettings.items() if u in urls}
        ids = {replica for replica, _ in replicas}
        self.num_answers = Counter({r: n for r, n in self.num_answers.items() if r in ids})
        if len(self._vettings) < len(urls):  # a replica never vetted: a round at once
            self._next_round = 0.0
        if self._reference is None or self._reference[1] in urls:
            return
        self._generation += 1
        successor = next((r for r in replicas if self._verdict(r[1]) == "agrees"), None)
        if successor is None:
            self._reference, self._expected, self._vettings = None, None, {}
        else:
            self._reference = successor
        self._next_round = 0.0

    def _maybe_vet(self, replicas: Sequence[Replica]) -> None:
        if self._round is not None or self._reference is None:
            return
        if self._clock() >= self._next_round:
            self._round = asyncio.create_task(self._run_round(replicas, self._generation))

    async def _run_round(self, replicas: Sequence[Replica], generation: int) -> None:
        """Vet what is due, again while replicas never vetted came meanwhile."""
        try:
            await self._vet_all(replicas, generation)
            while generation == self._generation and self._next_round_at() == 0.0:
                await self._vet_all(self._followed or replicas, generation)
        except Exception:  # a bug must not end vetting for good: logged, retried
            logger.exception("model %s: vetting its tokenizing replicas failed", self.model)
        finally:
            self._round = None
            self._next_round = self._next_round_at()

    def _next_round_at(self) -> float:
        """At once for a replica never vetted, else when the first verdict falls due."""
        known = self._expected is not None
        if known and any(url not in self._vettings for _, url in self._followed or ()):
            return 0.0
        due = [v.due for v in self._vettings.values()]
        return min(due, default=self._clock() + self._retry_s)

    async def _vet_all(self, replicas: Sequence[Replica], generation: int) -> None:
        reference = self._reference
        assert reference is not None
        if self._clock() >= self._vettings[reference[1]].due or self._expected is None:
            await self._vet_reference(reference, generation)
        if self._expected is None or generation != self._generation:
            return
        now = self._clock()
        due = [r for r in replicas if r != reference and self._due(r[1], now)]
        for i in range(0, len(due), VETTING_AT_ONCE):
            batch = due[i : i + VETTING_AT_ONCE]
            answers = await asyncio.gather(*(self._probe(url) for _, url in batch))
            if generation != self._generation:
                return
            for replica, answer in zip(batch, answers, strict=True):
                self._judge(replica, answer)

    def _due(self, url: str, now: float) -> bool:
        vetting = self._vettings.get(url)
        return vetting is None or now >= vetting.due

    async def _vet_reference(self, reference: Replica, generation: int) -> None:
        answer = await self._probe(reference[1])
        if generation != self._generation:
            return
        expected, now = self._expected, self._clock()
        failed = answer[0] is None or (expected is not None and _lost_chat(expected, answer))
        if failed:  # still the reference: what agreeing means is kept
            self._failing(reference[1], "unvetted")
            return
        if expected is not None and answer != expected:
            logger.warning(
                "model %s: replica %s (the reference) now tokenizes the probe differently:"
                " every other replica is vetted again",
                self.model,
                reference[0],
            )
            self._vettings = {}
            self._agreeing = None
        self._expected = answer
        self._vettings[reference[1]] = _Vetting("agrees", now + self._recheck_s)

    def _failing(self, url: str, verdict: Verdict) -> None:
        """A call or probe of ``url`` failed: ``verdict`` until vetted again, after a wait."""
        kept = self._vettings.get(url)
        num_failures = 1 if kept is None else kept.num_failures + 1
        wait = min(self._recheck_s, self._retry_s * 2 ** min(num_failures - 1, 30))
        self._vettings[url] = _Vetting(verdict, self._clock() + wait, num_failures)
        self._agreeing = None

    def _judge(self, replica: Replica, answer: ProbeAnswer) -> None:
        expected, now = self._expected, self._clock()
        assert expected is not None and self._reference is not None
        before = self._verdict(replica[1])
        if answer[0] is None or _lost_chat(expected, answer):
            self._failing(replica[1], "differs" if before == "differs" else "unvetted")
            return
        agrees = answer[0] == expected[0] and (expected[1] is None or answer[1] == expected[1])
        verdict: Verdict = "agrees" if agrees else "differs"
        self._vettings[replica[1]] = _Vetting(verdict, now + self._recheck_s)
        if verdict != before:
            self._agreeing = None
        if verdict == "differs" and before != "differs":
            logger.warning(
                "model %s: replica %s tokenizes the probe differently from replica %s (the"
                " reference): it is not asked to tokenize; its answers will show as"
                " token_mismatch",
                self.model,
                replica[0],
                self._reference[0],
            )
        elif verdict == "agrees" and before == "differs":
            logger.info(
                "model %s: replica %s tokenizes as the reference again", self.model, replica[0]
            )


def _first(
    candidates: Callable[[], Iterator[Replica]], limit: int, avoid: Collection[str]
) -> list[Replica]:
    """The first ``limit`` of ``candidates()``, those whose id is in ``avoid`` after the rest."""
    chosen = list(islice((r for r in candidates() if r[0] not in avoid), limit))
    if avoid and len(chosen) < limit:
        chosen += islice((r for r in candidates() if r[0] in avoid), limit - len(chosen))
    return chosen


def _lost_chat(expected: ProbeAnswer, answer: ProbeAnswer) -> bool:
    """The chat call failed where the reference's answered (a failure, not a difference)."""
    return expected[1] is not None and answer[1] is None
