"""vLLM's v1 scheduler stepped offline over one block pool under saturating chat load, in
engine time (the ingest benchmark's replica); deterministic for a pool, chats and call order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_chain
from kvindex.clients.workloads.chats import Chat, ChatSessions, ChatTurn
from kvindex.indexer.domain.events import Event

STEP_BASE_S = 0.008
"""Engine time of a step, whatever it computes."""
STEP_PER_TOKEN_S = 2e-5
"""Engine time per token computed in a step."""


@dataclass(slots=True, eq=False)
class _Request:
    request_id: int
    turn: ChatTurn
    tokens: list[int]
    """Prompt then output: the output is drawn up front, decoding reveals it."""
    num_prompt_tokens: int
    hashes: list[int]
    num_blocks_needed: int
    num_blocks: int = 0
    """Blocks held in the pool: the cached prefix hit at admission, then allocated ones."""
    num_computed: int = 0
    num_cached: int = 0
    """Leading blocks already cached (their store was published, or they were hits)."""

    @property
    def finished(self) -> bool:
        return self.num_computed >= len(self.tokens)


class StepScheduler:
    """Steps one replica: :meth:`step` is one scheduler step, :meth:`batches` all of them."""

    def __init__(
        self, pool: BlockPool, chats: ChatSessions, *, max_running: int, max_batched_tokens: int
    ) -> None:
        """``chats``' system prompts are hashed once, from ``pool.root``."""
        self._pool = pool
        self._chats = chats
        self._block_size = pool.block_size
        self._max_running = max_running
        self._max_batched_tokens = max_batched_tokens
        self._prompt_hashes: dict[int, list[int]] = {}
        self._known: dict[Chat, list[int]] = {}
        """Engine hashes of each idle chat's history (its next turn does not rehash it)."""
        self._running: list[_Request] = []
        self._waiting: _Request | None = None
        self._num_finished = 0
        self._next_id = 0
        self.num_blocks_stored = 0
        self.num_prompt_blocks = 0
        """Prompt blocks that could have hit (all but the block holding the last token)."""
        self.num_prompt_blocks_hit = 0

    def batches(self, start_ts: float) -> Iterator[tuple[float, list[Event]]]:
        """Step forever from ``start_ts``; ``(end ts, events)`` of every step with events."""
        ts = start_ts
        while True:
            events, num_tokens = self.step()
            ts += STEP_BASE_S + STEP_PER_TOKEN_S * num_tokens
            if events:
                yield ts, events

    def step(self) -> tuple[list[Event], int]:
        """One step; its events and the number of tokens it computed."""
        events: list[Event] = []
        budget = self._max_batched_tokens
        size = self._block_size
        for request in self._running:
            computed = request.num_computed + 1
            # Fast path: a decode step that neither fills, starts nor ends a block.
            if (
                request.num_computed >= request.num_prompt_tokens
                and computed % size > 1
                and computed < len(request.tokens)
                and budget > 0
            ):
                request.num_computed = computed
                budget -= 1
                continue
            budget -= self._advance(request, budget, events)
        while budget > 0 and len(self._running) < self._max_running:
            admitted = self._admit()
            if admitted is None:
                break
            budget -= self._advance(admitted, budget, events)
        if not self._running:
            raise RuntimeError("a request needs more blocks than the whole cache holds")
        if self._num_finished:
            self._retire()
        return events, self._max_batched_tokens - budget

    def _advance(self, request: _Request, budget: int, events: list[Event]) -> int:
        """Compute the request's next tokens (a prefill chunk or one decode token)."""
        left = request.num_prompt_tokens - request.num_computed
        count = min(left if left > 0 else 1, budget, len(request.tokens) - request.num_computed)
        if count <= 0:
            return 0
        size = self._block_size
        missing = -(-(request.num_computed + count) // size) - request.num_blocks
        if missing > 0:
            events += self._pool.allocate(request.request_id, missing)
            request.num_blocks += missing
        request.num_computed += count
        self._cache_full_blocks(request, events)
        if request.finished:
            self._num_finished += 1
        return count

    def _cache_full_blocks(self, request: _Request, events: list[Event]) -> None:
        first, end = request.num_cached, request.num_computed // self._block_size
        if end <= first:
            return
        events += self._pool.cache_full_blocks(
            request.request_id, request.tokens, request.hashes[:end]
        )
        request.num_cached = end
        self.num_blocks_stored += end - first

    def _admit(self) -> _Request | None:
        """Admit the waiting request if the pool can hold all of it; reuse its cached prefix."""
        if self._waiting is None:
            self._waiting = self._new_request()
        request = self._waiting
        if request.num_blocks_needed > self._pool.num_free - self._reserved():
            return None
        self._waiting = None
        num_prompt_blocks = (request.num_prompt_tokens - 1) // self._block_size
        hits = self._pool.touch(request.request_id, request.hashes, num_prompt_blocks)
        request.num_blocks = request.num_cached = hits
        request.num_computed = hits * self._block_size
        self.num_prompt_blocks += num_prompt_blocks
        self.num_prompt_blocks_hit += hits
        self._running.append(request)
        return request

    def _reserved(self) -> int:
        return sum(r.num_blocks_needed - r.num_blocks for r in self._running)

    def _retire(self) -> None:
        for request in [r for r in self._running if r.finished]:
            self._pool.release(request.request_id)
            if self._chats.end_turn(request.turn):
                self._known[request.turn.chat] = request.hashes
        self._running = [r for r in self._running if not r.finished]
        self._num_finished = 0

    def _new_request(self) -> _Request:
        turn = self._chats.next_turn()
        known = self._known.pop(turn.chat, None)
        if known is None:
            known = self._system_prompt_hashes(turn.chat)
        size = self._block_size
        parent = known[-1] if known else self._pool.root
        new = engine_chain(parent, turn.tokens[len(known) * size :], size)
        request_id, self._next_id = self._next_id, self._next_id + 1
        tokens = turn.tokens
        needed = -(-len(tokens) // size)
        return _Request(request_id, turn, tokens, turn.num_prompt_tokens, known + new, needed)

    def _system_prompt_hashes(self, chat: Chat) -> list[int]:
        hashes = self._prompt_hashes.get(chat.system_prompt)
        if hashes is None:
            size = self._block_size
            hashes = engine_chain(self._pool.root, chat.tokens, size)
            self._prompt_hashes[chat.system_prompt] = hashes
        return hashes
