"""``--lie``: a replica-sim lying as real fleets go wrong, for the proxy's truth loop to catch.
``drop-removals``: evictions unpublished (a publisher past its high-water mark, a lossy relay);
``events-off-restart[=N]``: after N answers (20) an empty cache, nothing published or replayed
(a pod restarted without ``--kv-events-config``); ``block-size=N``: events cut in N-token blocks
(an engine's event block size unlike the fleet's); ``tokenizer[=N]``: N more prompt tokens (1)
than the router counts (a BOS token or chat template the router lacks)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.clients.fake_vllm.block_pool import Admission, BlockPool
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import BlockRemoved, Event

EXTRA_TOKEN = 1  # the id the ``tokenizer`` lie puts before every prompt


class LieError(KvIndexError):
    """A ``--lie`` that is not one of :class:`LieKind` with a fitting value."""


class LieKind(enum.StrEnum):
    DROP_REMOVALS = "drop-removals"
    EVENTS_OFF_RESTART = "events-off-restart"
    BLOCK_SIZE = "block-size"
    TOKENIZER = "tokenizer"


_DEFAULTS = {LieKind.EVENTS_OFF_RESTART: 20, LieKind.TOKENIZER: 1}
_NEEDS_VALUE = frozenset({LieKind.BLOCK_SIZE})
_NO_VALUE = frozenset({LieKind.DROP_REMOVALS})


@dataclass(frozen=True, slots=True)
class Lie:
    kind: LieKind
    value: int = 0


def lie_of(text: str) -> Lie:
    name, _, raw = text.partition("=")
    try:
        kind = LieKind(name.strip())
    except ValueError:
        known = ", ".join(k.value for k in LieKind)
        raise LieError(f"lie {text!r}: unknown (known: {known})") from None
    if not raw:
        if kind in _NEEDS_VALUE:
            raise LieError(f"lie {text!r}: needs a value ({kind.value}=N)")
        return Lie(kind, _DEFAULTS.get(kind, 0))
    if kind in _NO_VALUE or not (raw.isascii() and raw.strip().isdigit()) or int(raw) < 1:
        raise LieError(f"lie {text!r}: the value must be a whole number >= 1 ({kind.value}=N)")
    return Lie(kind, int(raw))


class Lies:
    """A replica-sim's lies, applied where its engine publishes, tokenizes and finishes."""

    def __init__(self, texts: Sequence[str] = ()) -> None:
        found = [lie_of(t) for t in texts]
        self.kind_to_value = {lie.kind: lie.value for lie in found}
        if len(self.kind_to_value) != len(found):
            raise LieError(f"lies {list(texts)}: each kind at most once")
        self.num_answers = 0
        self.restarted = False

    def __contains__(self, kind: LieKind) -> bool:
        return kind in self.kind_to_value

    def pool(self, capacity_blocks: int, block_size: int, root: int) -> BlockPool:
        cut = self.kind_to_value.get(LieKind.BLOCK_SIZE)
        if cut is None or cut == block_size:
            return BlockPool(capacity_blocks, block_size, root)
        return RecutPool(capacity_blocks, block_size, root, cut)

    def published(self, events: list[Event]) -> list[Event]:
        if self.restarted:
            return []
        if LieKind.DROP_REMOVALS in self:
            return [e for e in events if not isinstance(e, BlockRemoved)]
        return events

    def prompt(self, tokens: list[int]) -> list[int]:
        extra = self.kind_to_value.get(LieKind.TOKENIZER)
        return tokens if extra is None else [EXTRA_TOKEN] * extra + tokens

    def restart_due(self) -> bool:
        """Count one answer; True once, when the events-off restart is due."""
        self.num_answers += 1
        after = self.kind_to_value.get(LieKind.EVENTS_OFF_RESTART)
        if after is None or self.restarted or self.num_answers < after:
            return False
        self.restarted = True
        return True


class RecutPool(BlockPool):
    """Caches in ``block_size`` blocks, publishes as a ``cut``-token pool that never evicts."""

    def __init__(self, capacity_blocks: int, block_size: int, root: int, cut: int) -> None:
        super().__init__(capacity_blocks, block_size, root, publish=False)
        self._shadow = BlockPool(1 << 40, cut, root)
        self._shadowed: set[int] = set()

    def admit(
        self,
        request_id: int,
        prompt: Sequence[int],
        total_tokens: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        chain: Sequence[int] | None = None,
    ) -> Admission | None:
        admission = super().admit(
            request_id,
            prompt,
            total_tokens,
            lora_name=lora_name,
            cache_salt=cache_salt,
            chain=chain,
        )
        if admission is None:
            return None
        shadow = self._shadow.admit(
            request_id, prompt, total_tokens, lora_name=lora_name, cache_salt=cache_salt
        )
        assert shadow is not None  # it never runs out of room
        self._shadowed.add(request_id)
        return Admission(admission.num_hit_blocks, shadow.events)

    def cache_full_blocks(
        self, request_id: int, tokens: Sequence[int], chain: Sequence[int] | None = None
    ) -> list[Event]:
        super().cache_full_blocks(request_id, tokens, chain)
        if request_id not in self._shadowed:  # inside admit, before the shadow's turn
            return []
        return self._shadow.cache_full_blocks(request_id, tokens)

    def release(self, request_id: int) -> None:
        super().release(request_id)
        if request_id in self._shadowed:
            self._shadowed.discard(request_id)
            self._shadow.release(request_id)
