"""Verdicts on the predictions' outcomes (:mod:`.predictions`), acted on; thread-safe.
Over-predicted: ``over_predicted_limit`` of a replica's last ``verdict_window`` compared
requests drop its streams' blocks (``Registry.ask_clear``) and discount its cache term until
``exact_to_trust`` exact since its last over-prediction (the window restarts after each).
Token mismatch: a model's first is logged, counted, named by ``/readyz``. Under-predicted:
counted by likely reason (:data:`UNDER_REASONS`)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvindex.clients.proxy.predictions import Prediction, Truth
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.indexer.fleet.registry import Freshness, RegistryView
from kvindex.indexer.index.protocol import IndexUnavailableError

logger = logging.getLogger("kvindex.proxy")
VERDICTS = ("over_predicted", "token_mismatch")
UNDER_REASONS = ("block_size", "partial_view", "lag", "lost_stores")
# A stream's events in blocks of another size; one reads partial; one is replaying or stale;
# else the engine stored blocks the index never heard of.
_COMPARED = frozenset({"exact", "over_predicted", "under_predicted"})
_REASON_TTL_S = 1.0


@dataclass(frozen=True, slots=True)
class VerdictRule:
    window: int = 10
    limit: int = 3
    exact_to_trust: int = 5


@dataclass(frozen=True, slots=True)
class Mismatch:
    model: str
    replica: str
    router_tokens: int
    engine_tokens: int

    def describe(self) -> str:
        return (
            f"token-count mismatch on model {self.model!r}: the router counts"
            f" {self.router_tokens} tokens, the engine {self.engine_tokens}"
            f" (routed to {self.replica})"
        )


@dataclass(slots=True)
class _Replica:
    recent: collections.deque[str]
    distrusted: bool = False
    num_exact_since: int = 0
    num_verdicts: int = 0
    reason_to_under: dict[str, int] = field(default_factory=dict)


class VerdictSeries(Protocol):
    def verdict(self, verdict: str) -> None: ...
    def under_predicted(self, reason: str) -> None: ...
    def distrusted(self, num_replicas: int) -> None: ...
    def mismatched(self, num_models: int) -> None: ...


@runtime_checkable
class ClearAsker(Protocol):
    def ask_clear(self, replica: str, at: float | None = None) -> None: ...


class Verdicts:
    def __init__(
        self,
        rule: VerdictRule,
        series: VerdictSeries,
        *,
        clear_view: Callable[[str], bool],
        under_reason: Callable[[Prediction], str] = lambda _prediction: "lost_stores",
    ) -> None:
        """``clear_view(replica)``: ask its blocks dropped (False: nobody to ask here)."""
        self._rule = rule
        self._series = series
        self._clear_view = clear_view
        self._under_reason = under_reason
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._distrusted: frozenset[str] = frozenset()
        self._model_to_mismatch: dict[str, Mismatch] = {}

    def judge(self, prediction: Prediction, truth: Truth | None, outcome: str) -> None:
        """Take one classified request into account (and act on a verdict it completes)."""
        if outcome == "token_mismatch" and truth is not None:
            self._mismatch(prediction, truth)
        if outcome not in _COMPARED:
            return
        replica = prediction.replica
        reason = self._under_reason(prediction) if outcome == "under_predicted" else None
        found, lifted, num_distrusted = self._judged(replica, outcome, reason)
        if reason is not None:
            self._series.under_predicted(reason)
        if lifted:
            logger.info("replica %s: predictions exact again; its cache term is trusted", replica)
        if found:
            self._over_predicted(replica)
        if found or lifted:
            self._series.distrusted(num_distrusted)

    def _judged(self, replica: str, outcome: str, reason: str | None) -> tuple[bool, bool, int]:
        with self._lock:
            record = self._replicas.get(replica)
            if record is None:
                recent = collections.deque[str](maxlen=self._rule.window)
                record = self._replicas[replica] = _Replica(recent)
            if reason is not None:
                record.reason_to_under[reason] = record.reason_to_under.get(reason, 0) + 1
            lifted = self._note(record, outcome)
            found = record.recent.count("over_predicted") >= self._rule.limit
            if found:
                record.recent.clear()
                record.distrusted, record.num_exact_since = True, 0
                record.num_verdicts += 1
            if found or lifted:
                self._distrusted = frozenset(r for r, v in self._replicas.items() if v.distrusted)
            return found, lifted, len(self._distrusted)

    def _note(self, record: _Replica, outcome: str) -> bool:
        """Add ``outcome`` to the window; whether it lifts the replica's discount."""
        record.recent.append(outcome)
        if outcome == "over_predicted":
            record.num_exact_since = 0
        elif outcome == "exact":
            record.num_exact_since += 1
            if record.distrusted and record.num_exact_since >= self._rule.exact_to_trust:
                record.distrusted = False
                return True
        return False

    def _over_predicted(self, replica: str) -> None:
        self._series.verdict("over_predicted")
        cleared = self._clear_view(replica)
        rule = self._rule
        logger.warning(
            "replica %s: %d of its last %d predictions over-predicted: %s; its cache term is"
            " discounted until %d are exact",
            replica,
            rule.limit,
            rule.window,
            "its streams' blocks are dropped" if cleared else "nobody here can drop its blocks",
            rule.exact_to_trust,
        )

    def _mismatch(self, prediction: Prediction, truth: Truth) -> None:
        seen = Mismatch(
            prediction.model, prediction.replica, prediction.num_tokens, truth.prompt_tokens
        )
        with self._lock:
            if seen.model in self._model_to_mismatch:
                return
            self._model_to_mismatch[seen.model] = seen
            num_models = len(self._model_to_mismatch)
        logger.warning("%s; further ones counted, not logged", seen.describe())
        self._series.verdict("token_mismatch")
        self._series.mismatched(num_models)

    # --- reading ---------------------------------------------------------------------------

    def distrusted(self) -> frozenset[str]:
        """The replicas whose cache term is discounted now (read per routed request)."""
        return self._distrusted

    def mismatches(self) -> list[Mismatch]:
        with self._lock:
            return sorted(self._model_to_mismatch.values(), key=lambda m: m.model)

    def view(self, replica: str) -> dict[str, object]:
        with self._lock:
            record = self._replicas.get(replica)
            if record is None:
                return {"distrusted": False, "num_verdicts": 0, "under_predicted": {}}
            return {
                "distrusted": record.distrusted,
                "num_verdicts": record.num_verdicts,
                "under_predicted": dict(record.reason_to_under),
            }


def under_reason_of(
    registry: RegistryView, *, clock: Callable[[], float] = time.monotonic
) -> Callable[[Prediction], str]:
    """Read from the fleet's records at most once a second per replica (each under-predicted
    request asks: every one, when a replica's block size is wrong)."""
    replica_to_reason: dict[str, tuple[float, str]] = {}

    def reason(prediction: Prediction) -> str:
        now, known = clock(), replica_to_reason.get(prediction.replica)
        if known is not None and now - known[0] < _REASON_TTL_S:
            return known[1]
        found = read(prediction)
        replica_to_reason[prediction.replica] = (now, found)
        return found

    def read(prediction: Prediction) -> str:
        replica, size = prediction.replica, prediction.block_size
        statuses = [s for s in registry.statuses() if s.stream.replica == replica]
        if any(s.health.block_size not in (0, size) for s in statuses):
            return "block_size"
        states = {s.freshness for s in statuses}
        if Freshness.PARTIAL in states:
            return "partial_view"
        if states & {Freshness.REPLAYING, Freshness.STALE, Freshness.ORPHANED}:
            return "lag"
        return "lost_stores"

    return reason


def view_clearer(registry: RegistryView) -> Callable[[str], bool]:

    def clear(replica: str) -> bool:
        if not isinstance(registry, ClearAsker):
            return False
        try:
            registry.ask_clear(replica)
        except IndexUnavailableError as exc:
            logger.warning("replica %s: its blocks could not be asked dropped: %s", replica, exc)
            return False
        return True

    return clear


def verdicts_of(settings: ProxySettings, registry: RegistryView, series: VerdictSeries) -> Verdicts:
    rule = VerdictRule(
        settings.verdict_window, settings.over_predicted_limit, settings.exact_to_trust
    )
    return Verdicts(
        rule, series, clear_view=view_clearer(registry), under_reason=under_reason_of(registry)
    )
