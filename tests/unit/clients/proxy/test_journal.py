"""The route journal: receipts made from what a request left (choice, answer, engine's usage),
the memory bound, the writer's batches to a sink (and a sink that fails), token ids kept."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec

import pytest

from kvindex.api.schemas import FreshnessView, ScoreEntry, ScoreResponse
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, Tokenizer
from kvindex.clients.proxy.access_log import Exchange
from kvindex.clients.proxy.journal import (
    Journal,
    JournalUnavailableError,
    Ticket,
    receipt_of,
    session_digest,
)
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.predictions import Truth
from kvindex.clients.proxy.receipt import decode_receipt, packed_ids, unpacked_ids
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Choice, Upstream

P = ParamSpec("P")


def _sync(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """An async test run on its own loop."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def _entry(replica: str, matched_blocks: int) -> ScoreEntry:
    return ScoreEntry(
        replica=replica,
        rank=0,
        matched_blocks=matched_blocks,
        matched_tokens=matched_blocks * 16,
        tiers={"gpu": matched_blocks, "cpu": 0, "other": 0},
        load=None,
        freshness=FreshnessView("live", 0.0, 0.1),
        terms={"cache": matched_blocks / 4, "load": 0.0},
        score=matched_blocks / 4,
    )


def _choice(num_candidates: int = 3) -> Choice:
    entries = [_entry(f"r{i}", max(0, 3 - i)) for i in range(1, num_candidates + 1)]
    answer = ScoreResponse(
        model="m", block_size=16, num_tokens=64, num_blocks=4, best="r1", policy="kv_aware",
        weights={"cache": 1.0}, scores=entries, num_candidates=num_candidates,
        num_matched=2,
    )  # fmt: skip
    upstreams = tuple(
        Upstream(e.replica, f"http://{e.replica}", 64 - e.matched_tokens, e.matched_tokens)
        for e in entries
    )
    return Choice(upstreams, 0.5, "m", 64, 16, reasons=_Answered(answer))


@dataclass(frozen=True)
class _Answered:
    """Reasons worded already (the scorer's own are held to its answers elsewhere)."""

    response: ScoreResponse

    def answer(self) -> ScoreResponse:
        return self.response


def _ticket(
    request_id: str,
    *,
    truth: Truth | None = None,
    told: bool = True,
    body: dict[str, Any] | None = None,
) -> Ticket:
    exchange = Exchange(request_id, "POST", "/v1/completions", "/v1/completions", 0.0)
    exchange.started = time.perf_counter()
    exchange.answered_by("r1", 0)
    ticket = Ticket(exchange, time.time())
    ticket.chose(_choice(), body or {"max_tokens": 7}, "user-1", keep=True)
    ticket.truth, ticket.told, ticket.status = truth, told, 200
    return ticket


def _journal(entries: int = 4, **settings: Any) -> Journal:
    return Journal(ProxySettings(journal_entries=entries, **settings))


@pytest.mark.parametrize(
    ("truth", "told", "outcome", "error"),
    [
        (Truth(64, 32), True, "exact", 0),
        (Truth(64, 16), True, "over_predicted", 16),
        (Truth(65, 32), True, "token_mismatch", None),
        (None, True, "unreported", None),
        (None, False, None, None),  # the answer was no whole 200: nothing compared
    ],
)
def test_a_receipt_names_the_prediction_and_its_outcome(
    truth: Truth | None, told: bool, outcome: str | None, error: int | None
) -> None:
    receipt = receipt_of(_ticket("a", truth=truth, told=told), 2, 3)
    assert receipt.answered_by == receipt.chosen == "r1" and receipt.fallbacks == ["r2", "r3"]
    assert [c.replica for c in receipt.candidates] == ["r1", "r2"]
    assert receipt.predicted_tokens == 32 and receipt.max_tokens == 7
    assert receipt.outcome == outcome and receipt.error_tokens == error
    assert receipt.cached_tokens == (None if truth is None else truth.cached_tokens)
    assert receipt.session == session_digest("user-1") and receipt.session != "user-1"


def test_fallbacks_stop_at_max_attempts() -> None:
    assert receipt_of(_ticket("a"), 4, 2).fallbacks == ["r2"]


@_sync
async def test_memory_keeps_the_newest_entries_and_an_id_sent_twice_its_last() -> None:
    journal = _journal(entries=3)
    for number in range(5):
        journal.record(_ticket(f"id-{number}"))
        await journal.flush()
    journal.record(_ticket("id-3", truth=Truth(64, 16)))
    await journal.flush()
    assert len(journal) == 3
    assert await journal.find("id-0") is None and await journal.find("id-1") is None
    found = await journal.find("id-3")
    assert found is not None and decode_receipt(found).outcome == "over_predicted"
    assert [decode_receipt(r).id for r in await journal.newest(10)] == ["id-2", "id-4", "id-3"]
    assert [decode_receipt(r).id for r in await journal.newest(1)] == ["id-3"]
    await journal.close()


@_sync
async def test_a_writer_behind_drops_the_oldest_pending_past_the_bound() -> None:
    journal = _journal(entries=3)
    for number in range(5):  # the writer never ran: five pending, the bound is three
        journal.record(_ticket(f"id-{number}"))
    assert len(journal) == 3 and await journal.find("id-1") is None
    await journal.flush()
    assert [decode_receipt(r).id for r in await journal.newest(5)] == ["id-2", "id-3", "id-4"]


@_sync
async def test_a_pending_receipt_is_found_before_its_batch_is_written() -> None:
    journal = _journal()
    journal.record(_ticket("soon"))
    found = await journal.find("soon")
    assert found is not None and decode_receipt(found).id == "soon"
    await journal.close()


@_sync
async def test_requests_not_scored_and_a_journal_off_keep_nothing() -> None:
    journal = _journal()
    exchange = Exchange("x", "GET", "/v1/{path}", "/v1/models", time.perf_counter())
    journal.record(Ticket(exchange, time.time()))  # a 400 before any choice
    journal.record(_ticket("i" * 4097))  # an id no one could ask for
    off = _journal(entries=0)
    off.record(_ticket("y"))
    await journal.flush()
    await off.flush()
    assert len(journal) == 0 and len(off) == 0 and not off.enabled


class _Sink:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[tuple[str, bytes]]] = []
        self.fail = fail

    def append(self, receipts: Sequence[tuple[str, bytes]]) -> None:
        if self.fail:
            raise ConnectionError("store down")
        self.batches.append(list(receipts))

    def find(self, request_id: str) -> bytes | None:
        if self.fail:
            raise ConnectionError("store down")
        return next((d for b in self.batches for i, d in b if i == request_id), None)

    def newest(self, count: int) -> list[bytes]:
        if self.fail:
            raise ConnectionError("store down")
        return [d for b in self.batches for _i, d in b][::-1][:count]


@_sync
async def test_the_writer_sends_batches_in_the_background() -> None:
    sink = _Sink()
    journal = Journal(ProxySettings(journal_entries=2), sink=sink)
    for number, batch in enumerate((["id-0", "id-1"], ["id-2"]), start=1):
        for request_id in batch:
            journal.record(_ticket(request_id))
        async with asyncio.timeout(5):
            while len(sink.batches) < number:
                await asyncio.sleep(0.01)
    assert [[i for i, _ in b] for b in sink.batches] == [["id-0", "id-1"], ["id-2"]]
    assert len(journal) == 2  # memory holds two; the sink all
    found = await journal.find("id-0")
    assert found is not None and decode_receipt(found).id == "id-0"
    await journal.close()


@_sync
async def test_a_failing_sink_keeps_receipts_in_memory_and_counts_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dropped: list[int] = []
    journal = Journal(
        ProxySettings(journal_entries=4), sink=_Sink(fail=True), on_dropped=dropped.append
    )
    journal.record(_ticket("a"))
    journal.record(_ticket("b"))
    await journal.flush()
    assert journal.num_dropped == 2 and dropped == [2] and await journal.find("a") is not None
    assert caplog.text.count("the store takes no receipts") == 1
    assert [decode_receipt(r).id for r in await journal.newest(5)] == ["a", "b"]
    with pytest.raises(JournalUnavailableError):  # not here, and the store cannot say
        await journal.find("elsewhere")


@_sync
async def test_an_outage_of_the_sink_is_logged_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every receipt the store did not take is counted; the log says when it stopped taking
    them and when it took them again, not once per batch."""
    sink, dropped = _Sink(fail=True), list[int]()
    journal = Journal(ProxySettings(journal_entries=8), sink=sink, on_dropped=dropped.append)
    for number in range(5):
        journal.record(_ticket(f"down-{number}"))
        await journal.flush()
    sink.fail = False
    for number in range(3):
        journal.record(_ticket(f"up-{number}"))
        await journal.flush()
    assert dropped == [1] * 5 and journal.num_dropped == 5
    assert caplog.text.count("the store takes no receipts") == 1
    assert caplog.text.count("the store takes receipts again (5 not taken)") == 1
    assert [i for b in sink.batches for i, _ in b] == ["up-0", "up-1", "up-2"]
    await journal.close()


@_sync
async def test_receipts_the_store_did_not_take_are_a_metric_shown_from_zero() -> None:
    metrics = ProxyMetrics()
    series = b"kvindex_proxy_receipt_write_failures_total"
    assert series + b" 0.0" in metrics.render()  # present before any failure
    failures = metrics.receipt_write_failures
    journal = Journal(
        ProxySettings(journal_entries=4), sink=_Sink(fail=True), on_dropped=failures.inc
    )
    for request_id in ("a", "b", "c"):
        journal.record(_ticket(request_id))
    await journal.flush()
    assert series + b" 3.0" in metrics.render()


@_sync
async def test_without_a_sink_a_receipt_is_made_when_read_and_equals_the_eager_one() -> None:
    """Memory only: the ticket is kept as the request ended, and the receipt read from it is
    the one the writer would have made then (its duration ends when the request did)."""
    lazy = _journal(entries=4)
    eager = Journal(ProxySettings(journal_entries=4), sink=_Sink())
    ticket = _ticket("a")
    lazy.record(ticket)
    eager.record(ticket)
    await eager.flush()
    await asyncio.sleep(0.02)  # a lazily made receipt's duration is not the reading's time
    made_late = await lazy.find("a")
    assert made_late is not None and made_late == await eager.find("a")
    assert [r for r in await lazy.newest(5)] == [made_late]
    assert decode_receipt(made_late).duration_ms < 20
    await eager.close()


class _Words:
    async def encode_prompt(self, prompt: str) -> list[int]:
        return [len(word) for word in prompt.split()]

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        return [len(str(m.get("content", ""))) for m in messages]


@pytest.mark.parametrize(
    ("body", "ids"),
    [
        ({"prompt": "a bb ccc dddd eeeee"}, [1, 2, 3]),
        ({"messages": [{"role": "user", "content": "xy"}]}, [2]),
        ({"prompt": [5, 6, 7, 8]}, [5, 6, 7]),
        ({"prompt": [5, -1]}, None),  # not token ids: none kept
    ],
)
@_sync
async def test_token_ids_are_kept_up_to_their_bytes(
    body: dict[str, Any], ids: list[int] | None
) -> None:
    words: Any = _Words()
    tokenizer: Tokenizer = words
    journal = Journal(
        ProxySettings(journal_entries=4, journal_token_bytes=12), tokenizers=lambda _m: tokenizer
    )
    assert journal.keeps_bodies
    journal.record(_ticket("t", body=body))
    await journal.flush()
    found = await journal.find("t")
    assert found is not None
    kept = decode_receipt(found).token_ids
    assert (None if kept is None else unpacked_ids(kept)) == ids


@_sync
async def test_without_token_bytes_no_body_is_kept() -> None:
    journal = _journal()
    ticket = _ticket("t")
    ticket.chose(_choice(), {"prompt": "secret words"}, None, keep=journal.keeps_bodies)
    assert ticket.body is None
    journal.record(ticket)
    await journal.flush()
    found = await journal.find("t")
    assert found is not None and decode_receipt(found).token_ids is None


def test_packed_ids_round_trip_and_refuse_what_is_not_u32() -> None:
    ids = [0, 1, 2**32 - 1, 151_643]
    assert unpacked_ids(packed_ids(ids)) == ids
    with pytest.raises(ValueError, match="u32"):
        unpacked_ids("AAA=")  # two bytes
    with pytest.raises(ValueError):
        unpacked_ids("not base64!")


class _Broken:
    async def encode_prompt(self, prompt: str) -> list[int]:
        raise RuntimeError("a bug")

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        raise RuntimeError("a bug")


@_sync
async def test_a_batch_that_fails_is_logged_and_the_writer_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken: Any = _Broken()
    sink = _Sink()
    journal = Journal(
        ProxySettings(journal_entries=4, journal_token_bytes=64),
        sink=sink,
        tokenizers=lambda _m: broken,
    )
    journal.record(_ticket("lost", body={"prompt": "some words"}))
    async with asyncio.timeout(5):
        while "a batch of receipts was lost" not in caplog.text:
            await asyncio.sleep(0.01)
    journal.record(_ticket("kept", body={"prompt": [1, 2, 3]}))  # ids in the body: no tokenizer
    async with asyncio.timeout(5):
        while not sink.batches:
            await asyncio.sleep(0.01)
    assert [i for i, _ in sink.batches[0]] == ["kept"]
    await journal.close()
