"""The route journal: a receipt per routed request, the newest ``proxy.journal_entries`` in
memory by id (an id sent twice keeps its last) and, given a sink, in a store every proxy shares;
written once the request ends, in batches, by one background task: no store call on its path.
Without a sink (nor token ids to keep) a request's ticket is kept as it ended and its receipt
made only when read: the same receipt, no work for receipts nobody reads."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError, chat_options_of
from kvindex.clients.proxy.access_log import Exchange
from kvindex.clients.proxy.predictions import Prediction, Truth, outcome_of
from kvindex.clients.proxy.receipt import Receipt, encode_receipt, packed_ids
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Choice
from kvindex.indexer.domain.errors import KvIndexError

logger = logging.getLogger("kvindex.proxy")
MAX_ID_CHARS = 4096  # a longer request id gets no receipt (nor can it be asked for)
FLUSH_DELAY_S = 0.05  # a finished request's receipt waits this long for its batch


class JournalUnavailableError(KvIndexError):
    """The shared store of receipts cannot be read."""


class ReceiptSink(Protocol):
    """A shared store of receipts; blocking calls (the journal runs them off the loop)."""

    def append(self, receipts: Sequence[tuple[str, bytes]]) -> None: ...
    def find(self, request_id: str) -> bytes | None: ...
    def newest(self, count: int) -> list[bytes]: ...


@dataclass(slots=True)
class Ticket:
    """One request's receipt as it is filled in while the request is answered."""

    exchange: Exchange
    time: float
    choice: Choice | None = None
    body: dict[str, Any] | None = None
    max_tokens: int | None = None
    session: str | None = None
    truth: Truth | None = None
    told: bool = False
    status: int = 0
    num_tokens: int = 0  # a head's whole prompt, once counted (0: the choice's count holds)
    ended: float = 0.0
    """``time.perf_counter()`` when the request ended (recorded)."""

    def chose(
        self, choice: Choice, body: dict[str, Any] | None, session: str | None, *, keep: bool
    ) -> None:
        """The scorer's choice for ``body`` (None: a pass-through), kept if ``keep``."""
        self.choice, self.session = choice, session_digest(session)
        if body is not None:
            self.body = body if keep else None
            limit = body.get("max_tokens", body.get("max_completion_tokens"))
            self.max_tokens = limit if type(limit) is int else None

    def counted(self, num_tokens: int) -> None:
        """The prompt's tokens, counted since the choice (a head's whole)."""
        self.num_tokens = num_tokens

    def telling(self, on_truth: Callable[[Truth | None], object]) -> Callable[[Truth | None], None]:
        def told(truth: Truth | None) -> None:
            self.truth, self.told = truth, True
            on_truth(truth)

        return told


class Journal:
    """The receipts of one proxy process; used on its event loop."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        sink: ReceiptSink | None = None,
        tokenizers: Callable[[str], Tokenizer | None] = lambda _model: None,
        on_dropped: Callable[[int], object] = lambda _count: None,
    ) -> None:
        """``on_dropped``: told how many receipts the sink did not take, each time."""
        self.enabled = settings.journal_entries > 0
        self._entries = settings.journal_entries
        self._num_candidates = settings.journal_candidates
        self._max_attempts = settings.max_attempts
        self._max_ids = settings.journal_token_bytes // 4
        self._sink = sink
        self._lazy = sink is None and not self._max_ids
        self._tokenizers = tokenizers
        self._on_dropped = on_dropped
        self._kept: OrderedDict[str, bytes | Ticket] = OrderedDict()
        """Receipts as JSON, or (lazy) the tickets they are made of when read."""
        self._pending: list[Ticket] = []
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._outage = False  # the sink failed last: logged once, until a write succeeds
        self.num_dropped = 0  # receipts the shared store did not take (kept in memory only)

    def ticket(self, exchange: Exchange) -> Ticket:
        return Ticket(exchange, time.time())

    @property
    def keeps_bodies(self) -> bool:
        return self._max_ids > 0

    def record(self, ticket: Ticket) -> None:
        """Keep ``ticket``'s receipt (a request the scorer routed; others are ignored)."""
        if not self.enabled or ticket.choice is None or ticket.choice.reasons is None:
            return
        request_id = ticket.exchange.request_id
        if len(request_id) > MAX_ID_CHARS:
            return
        ticket.ended = time.perf_counter()
        if self._lazy:
            self._keep(request_id, ticket)
            return
        self._pending.append(ticket)
        if len(self._pending) > self._entries:  # the writer is behind: the oldest go
            del self._pending[0]
        if self._task is None or self._task.done():
            self._wake, self._lock = asyncio.Event(), asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._write())
        assert self._wake is not None
        self._wake.set()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush()

    async def _write(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_DELAY_S)
            try:
                await asyncio.shield(self.flush())  # a batch taken is written, even at close
            except Exception:  # a bug here must not stop the receipts that follow
                logger.exception("journal: a batch of receipts was lost")

    async def flush(self) -> None:
        """Every pending receipt made, kept in memory, then sent to the sink in one batch."""
        lock = self._lock or asyncio.Lock()
        async with lock:
            tickets, self._pending = self._pending, []
            batch = [(t.exchange.request_id, encode_receipt(await self._made(t))) for t in tickets]
            for request_id, data in batch:
                self._keep(request_id, data)
            if self._sink is not None and batch:
                await self._sent(batch)

    def _keep(self, request_id: str, data: bytes | Ticket) -> None:
        kept = self._kept
        kept.pop(request_id, None)
        kept[request_id] = data
        while len(kept) > self._entries:
            kept.popitem(last=False)

    async def _sent(self, batch: list[tuple[str, bytes]]) -> None:
        assert self._sink is not None
        try:
            await asyncio.to_thread(self._sink.append, batch)
        except Exception as exc:  # the store is down: the receipts stay in memory
            self.num_dropped += len(batch)
            self._on_dropped(len(batch))
            if not self._outage:
                self._outage = True
                logger.warning(
                    "journal: the store takes no receipts (kept in memory only until it does): %r",
                    exc,
                )
            return
        if self._outage:
            self._outage = False
            logger.warning(
                "journal: the store takes receipts again (%d not taken)", self.num_dropped
            )

    def __len__(self) -> int:
        return len(self._kept) + len(self._pending)

    async def find(self, request_id: str) -> bytes | None:
        """The receipt of ``request_id``: this process's, else the shared store's (None)."""
        data = self._kept.get(request_id)
        if isinstance(data, Ticket):
            return encode_receipt(await self._made(data))
        if data is not None:
            return data
        for ticket in reversed(self._pending):
            if ticket.exchange.request_id == request_id:
                return encode_receipt(await self._made(ticket))
        if self._sink is None:
            return None
        try:
            return await asyncio.to_thread(self._sink.find, request_id)
        except Exception as exc:
            logger.warning("journal: the store's receipts unreadable: %r", exc)
            raise JournalUnavailableError("the shared journal cannot be read now") from exc

    async def newest(self, count: int) -> list[bytes]:
        """The newest ``count`` receipts, oldest first: the shared store's when there is one."""
        await self.flush()
        if self._sink is not None:
            try:
                return (await asyncio.to_thread(self._sink.newest, count))[::-1]
            except Exception as exc:
                logger.warning("journal: the store's receipts unreadable, this proxy's: %r", exc)
        kept = list(self._kept.values())
        return [await self._encoded(k) for k in kept[max(0, len(kept) - count) :]]

    async def _encoded(self, kept: bytes | Ticket) -> bytes:
        return encode_receipt(await self._made(kept)) if isinstance(kept, Ticket) else kept

    async def _made(self, ticket: Ticket) -> Receipt:
        receipt = receipt_of(ticket, self._num_candidates, self._max_attempts)
        if self._max_ids and ticket.body is not None and ticket.choice is not None:
            ids = await self._token_ids(ticket.choice.model, ticket.body)
            receipt.token_ids = None if ids is None else packed_ids(ids[: self._max_ids])
        return receipt

    async def _token_ids(self, model: str, body: dict[str, Any]) -> list[int] | None:
        # The router's tokenizer again: it caches recent texts, so this is mostly a lookup.
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return prompt
        tokenizer = self._tokenizers(model)
        try:
            if tokenizer is not None and isinstance(prompt, str):
                return await tokenizer.encode_prompt(prompt)
            if tokenizer is not None and isinstance(messages, list):
                return await tokenizer.encode_messages(messages, chat_options_of(body))
        except (TokenizerError, ValueError, OSError):
            return None
        return None


def receipt_of(ticket: Ticket, num_candidates: int, max_attempts: int) -> Receipt:
    """``ticket``'s receipt (its choice explained: the picker's ``explain``)."""
    choice, exchange = ticket.choice, ticket.exchange
    assert choice is not None and choice.reasons is not None
    answer = choice.reasons.answer()
    upstreams = choice.upstreams
    receipt = Receipt(
        id=exchange.request_id,
        time=ticket.time,
        route=exchange.path,
        model=answer.model,
        num_tokens=ticket.num_tokens or answer.num_tokens,
        block_size=answer.block_size,
        num_blocks=answer.num_blocks,
        policy=answer.policy,
        weights=answer.weights,
        rule=answer.rule,
        degraded=answer.degraded,
        unhealthy=answer.unhealthy,
        num_candidates=answer.num_candidates,
        candidates=answer.scores[:num_candidates],
        chosen=upstreams[0].replica if upstreams else None,
        fallbacks=[u.replica for u in upstreams[1:max_attempts]],
        status=ticket.status,
        duration_ms=round(((ticket.ended or time.perf_counter()) - exchange.started) * 1000, 3),
        untokenized=choice.untokenized,
        head=choice.rest is not None,
        max_tokens=ticket.max_tokens,
        session=ticket.session,
    )
    _answered(receipt, ticket)
    return receipt


def _answered(receipt: Receipt, ticket: Ticket) -> None:
    exchange, choice = ticket.exchange, ticket.choice
    assert choice is not None
    if exchange.first_byte_s is None:
        return
    receipt.answered_by, receipt.retries = exchange.replica, exchange.retries
    receipt.ttfb_ms = round(exchange.first_byte_s * 1000, 3)
    upstream = next((u for u in choice.upstreams if u.replica == exchange.replica), None)
    prediction = None if upstream is None else choice.prediction(upstream)
    if prediction is None:
        return
    receipt.predicted_tokens = prediction.matched_tokens
    if ticket.told:
        _compared(receipt, prediction, ticket.truth)


def _compared(receipt: Receipt, prediction: Prediction, truth: Truth | None) -> None:
    receipt.outcome, receipt.error_tokens = outcome_of(prediction, truth)
    if truth is not None:
        receipt.prompt_tokens, receipt.cached_tokens = truth.prompt_tokens, truth.cached_tokens


def session_digest(session: str | None) -> str | None:
    if session is None:
        return None
    return hashlib.blake2b(session.encode(), digest_size=8).hexdigest()
