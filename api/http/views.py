"""The bodies of the read-only routes, from fleet and store state (store calls: off-loop)."""

from __future__ import annotations

import time

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.load.model import Load
from kvindex.api.load.store import LoadStore
from kvindex.api.schemas import (
    ConfigView,
    FreshnessView,
    HealthView,
    LoadView,
    ModelView,
    ReplicaView,
    StatsView,
    StreamView,
)
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.domain.health import StreamCounters
from kvindex.indexer.fleet.registry import RegistryView, StreamStatus, fleet_totals
from kvindex.indexer.fleet.replica_health import HealthPolicy, ReplicaHealth
from kvindex.indexer.index.protocol import BlockIndex


def replica_views(
    registry: RegistryView,
    index: BlockIndex,
    loads: LoadStore,
    block_sizes: BlockSizeCheck,
    policy: HealthPolicy | None = None,
) -> list[ReplicaView]:
    """``GET /replicas`` in the registry's order; a replica's state is its worst stream's."""
    specs = registry.replicas()
    replica_to_load = loads.get_many([r.id for r in specs])
    all_statuses = registry.statuses()
    mismatched = block_sizes.mismatches(all_statuses, specs)
    health = registry.replica_health()
    now = time.time()
    statuses: dict[str, list[StreamStatus]] = {}
    for status in all_statuses:
        statuses.setdefault(status.stream.replica, []).append(status)
    views = []
    for spec in specs:
        streams = [
            stream_view(index, s, mismatch=s.stream in mismatched)
            for s in statuses.get(spec.id, [])
        ]
        views.append(
            ReplicaView(
                id=spec.id,
                model=spec.model,
                events=spec.events,
                replay=spec.replay,
                url=spec.url,
                dp_size=spec.dp_size,
                state=_worst([s.freshness.state for s in streams]),
                streams=streams,
                load=_load_view(replica_to_load.get(spec.id)),
                health=_health_view(health.get(spec.id), now, policy or HealthPolicy()),
            )
        )
    return views


def _health_view(
    record: ReplicaHealth | None, now: float, policy: HealthPolicy
) -> HealthView | None:
    if record is None:
        return None
    breaker = "closed"
    if record.breaker_open_until is not None:
        breaker = "half-open" if record.half_open(now) else "open"
    checked = record.checked_at
    return HealthView(
        state="healthy" if record.ejection(now, policy) is None else "ejected",
        detail=record.describe(now, policy),
        check_failures=record.check_failures,
        check_successes=record.check_successes,
        checked_s_ago=None if checked is None else max(0.0, now - checked),
        breaker=breaker,
        last_error=record.last_error,
        num_ejections=record.num_ejections,
    )


def stream_view(index: BlockIndex, status: StreamStatus, *, mismatch: bool = False) -> StreamView:
    stats = index.stats(status.stream)
    health = status.health
    return StreamView(
        rank=status.stream.rank,
        freshness=FreshnessView(
            status.freshness.value,
            health.lag_s,
            status.silent_s,
            health.partial,
            health.partial_since,
        ),
        connected=health.connected,
        last_seq=health.last_seq,
        blocks={t.name.lower(): stats.blocks_by_tier.get(t, 0) for t in Tier},
        counters=_counters_view(health),
        block_size=health.block_size or None,
        block_size_mismatch=mismatch,
        owner=status.owner,
    )


def stats_view(registry: RegistryView, index: BlockIndex) -> StatsView:
    totals = fleet_totals(registry, index)
    counters = totals.counters
    return StatsView(
        replicas=totals.num_replicas,
        streams=totals.num_streams,
        blocks={t.name.lower(): count for t, count in totals.blocks_by_tier.items()},
        batches=counters.num_batches,
        gaps=counters.num_gaps,
        replays=counters.num_replays,
        restarts=counters.num_restarts,
        decode_errors=counters.num_decode_errors + totals.unrouted.num_undecodable,
    )


def config_view(settings: ApiSettings, scorer: Scorer) -> ConfigView:
    models = {m: ModelView(scorer.block_size(m)) for m in scorer.known_models()}
    rules = [rule.as_table() for rule in settings.rules]
    return ConfigView(settings.default_policy, settings.weights.as_dict(), models, rules)


def _counters_view(counters: StreamCounters) -> dict[str, int]:
    return {
        "num_batches": counters.num_batches,
        "num_gaps": counters.num_gaps,
        "num_unrepaired_gaps": counters.num_unrepaired_gaps,
        "num_replays": counters.num_replays,
        "num_replay_failures": counters.num_replay_failures,
        "num_replay_truncated": counters.num_replay_truncated,
        "num_restarts": counters.num_restarts,
        "num_duplicates": counters.num_duplicates,
        "num_rebuilds": counters.num_rebuilds,
        "decode_errors": counters.num_decode_errors,
        "store_errors": counters.num_store_errors,
    }


def _worst(states: list[str]) -> str:
    for state in ("orphaned", "stale", "replaying", "partial"):
        if state in states:
            return state
    return "live" if states else "stale"


def _load_view(load: Load | None) -> LoadView | None:
    if load is None:
        return None
    return LoadView(
        load.running, load.waiting, load.kv_usage, max(0.0, time.time() - load.ts), load.source
    )
