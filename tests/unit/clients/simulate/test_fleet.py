"""The simulator's own accounting on cases small enough to compute by hand.

Fleet used unless a test says otherwise: blocks of 4 tokens, prefill 4 tokens/s (1 token
= 0.25 s), decode 1 token/s, one router that always picks the replica named in the test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from kvindex.clients.simulate.fleet import (
    FleetResult,
    FleetSettings,
    FleetSim,
    Job,
    ReplicaLoad,
    SimulationError,
)
from kvindex.clients.simulate.run import (
    ceiling_hit_rate,
    percentile,
    policy_stats,
    single_cache_hit_rate,
)
from kvindex.clients.workloads.trace import TraceRequest
from kvindex.indexer.domain.events import BlockRemoved, BlockStored, Event


class Fixed:
    """Routes request i to ``picks[i]`` (default r0) and records every event."""

    def __init__(self, picks: Sequence[str] = ()) -> None:
        self.picks = list(picks)
        self.events: list[tuple[float, str, Event]] = []
        self.seen_loads: list[list[ReplicaLoad]] = []

    async def route(self, job: Job, now: float, loads: Sequence[ReplicaLoad]) -> str:
        self.seen_loads.append(list(loads))
        return self.picks[job.index] if job.index < len(self.picks) else "r0"

    def emitted(self, replica: str, events: list[Event], now: float) -> None:
        self.events.extend((now, replica, e) for e in events)


def fleet(**kw: object) -> FleetSettings:
    base: dict[str, object] = {
        "replicas": 1,
        "capacity_blocks": 8,
        "block_size": 4,
        "prefill_tps": 4.0,
        "decode_tps": 1.0,
        "max_running": 8,
    }
    base.update(kw)
    return FleetSettings(**base)  # type: ignore[arg-type]


def req(t: float, prompt: Sequence[int], out: int = 0, **kw: object) -> TraceRequest:
    return TraceRequest(t, len(prompt), out, prompt=list(prompt), **kw)  # type: ignore[arg-type]


def run(settings: FleetSettings, requests: Sequence[TraceRequest], router: Fixed) -> FleetResult:
    return asyncio.run(FleetSim(settings, router, requests).run())


def test_a_repeated_prompt_hits_every_block_but_the_last_token() -> None:
    # A: 9 tokens -> 2 full blocks, no hit: prefill 9 tokens = 2.25 s; decode 2 s.
    # B: same prompt at t=10: both blocks cached (hits stop before the block holding the
    # last token: (9 - 1) // 4 = 2), 1 token computed = 0.25 s.
    prompt = list(range(9))
    result = run(fleet(), [req(0.0, prompt, 2), req(10.0, prompt, 2)], Fixed())
    a, b = result.outcomes
    assert (a.hit_tokens, a.ttft_s, a.queue_s) == (0, 2.25, 0.0)
    assert (b.hit_tokens, b.ttft_s, b.queue_s) == (8, 0.25, 0.0)
    stats = policy_stats("fixed", result, 0.0)
    assert stats.hit_rate == pytest.approx(8 / 18)
    assert stats.prefill_tokens == 18 - 8


def test_a_prompt_of_whole_blocks_recomputes_its_last_block() -> None:
    prompt = list(range(8))  # 2 full blocks; the last token's block is never a hit
    result = run(fleet(), [req(0.0, prompt), req(5.0, prompt)], Fixed())
    assert [o.hit_tokens for o in result.outcomes] == [0, 4]
    assert result.outcomes[1].ttft_s == 1.0  # 4 tokens at 4/s


def test_prefills_run_one_after_another_and_queue() -> None:
    # A: 8 tokens at t=0 -> prefill until 2.0. B arrives at 0.5 (4 tokens, no sharing):
    # it waits for A's prefill (queue 1.5 s), then 1 s of prefill: TTFT = 3.0 - 0.5.
    result = run(fleet(), [req(0.0, range(8)), req(0.5, range(100, 104))], Fixed())
    a, b = result.outcomes
    assert a.ttft_s == 2.0
    assert (b.queue_s, b.ttft_s) == (1.5, 2.5)
    # the router saw B's arrival with A running and nothing waiting
    assert result.queue_samples == [0, 0]


def test_queue_depth_is_sampled_at_arrivals() -> None:
    requests = [req(0.0, range(40)), req(1.0, range(100, 104)), req(2.0, range(200, 204))]
    result = run(fleet(capacity_blocks=32), requests, Fixed())
    # at t=1 A (10 s of prefill) runs, nothing waits; at t=2 B waits
    assert result.queue_samples == [0, 0, 1]
    assert policy_stats("x", result, 0.0).queue_max == 1


def test_a_request_waits_for_room_in_the_pool() -> None:
    # capacity 4 blocks; A needs 3 (8 prompt + 4 output tokens), B needs 3: B is admitted
    # when A finishes (prefill 2 s + decode 4 s = 6 s), then 2 s of prefill.
    requests = [req(0.0, range(8), 4), req(0.0, range(100, 108), 4)]
    result = run(fleet(capacity_blocks=4), requests, Fixed())
    _, b = result.outcomes
    assert (b.queue_s, b.ttft_s) == (6.0, 8.0)


def test_the_batch_limit_holds_requests_back() -> None:
    requests = [req(0.0, range(4), 10), req(0.0, range(100, 104), 1)]
    result = run(fleet(max_running=1), requests, Fixed())
    _, b = result.outcomes
    # A: prefill 1 s, decode 10 s -> B admitted at 11 s, first token at 12 s
    assert (b.queue_s, b.ttft_s) == (11.0, 12.0)


def test_lru_eviction_is_published_and_costs_the_hit() -> None:
    # capacity 4: A caches 2 blocks, C (16 tokens) needs all 4 -> A's blocks are evicted;
    # A again computes everything.
    a_prompt, c_prompt = list(range(8)), list(range(100, 116))
    router = Fixed()
    requests = [req(0.0, a_prompt), req(10.0, c_prompt), req(20.0, a_prompt)]
    result = run(fleet(capacity_blocks=4), requests, router)
    assert [o.hit_tokens for o in result.outcomes] == [0, 0, 0]
    kinds = [(t, type(e).__name__) for t, _, e in router.events]
    assert kinds[0] == (0.0, "BlockStored")
    removed = [e for _, _, e in router.events if isinstance(e, BlockRemoved)]
    stored = [e for _, _, e in router.events if isinstance(e, BlockStored)]
    gone = [h for e in removed for h in e.block_hashes]
    assert len(gone) == 2 + 2  # A's two at t=10, two of C's at t=20
    assert set(gone[:2]) == set(stored[0].block_hashes)


def test_a_known_answer_is_cached_for_the_next_turn() -> None:
    # turn 1: 4-token prompt + 4-token answer -> after it finishes, 2 blocks are cached;
    # turn 2's prompt = turn 1 + answer + 4 new tokens: 8 tokens hit.
    q1, answer, q2 = list(range(4)), list(range(50, 54)), list(range(60, 64))
    turn1 = req(0.0, q1, 4, output=answer)
    turn2 = req(20.0, q1 + answer + q2, 1)
    result = run(fleet(), [turn1, turn2], Fixed())
    assert result.outcomes[1].hit_tokens == 8


def test_too_long_a_request_is_rejected_not_crashed() -> None:
    requests = [req(0.0, range(40)), req(1.0, range(4))]
    result = run(fleet(capacity_blocks=4), requests, Fixed())
    assert [o.rejected for o in result.outcomes] == [True, False]
    stats = policy_stats("x", result, 0.0)
    assert (stats.rejected, stats.requests) == (1, 2)


def test_loads_are_what_a_replica_would_report() -> None:
    router = Fixed(["r0", "r0", "r1"])
    requests = [req(0.0, range(40)), req(1.0, range(100, 104)), req(2.0, range(200, 204))]
    run(fleet(replicas=2, capacity_blocks=32), requests, router)
    at_t2 = {load.replica: load for load in router.seen_loads[2]}
    assert (at_t2["r0"].running, at_t2["r0"].waiting) == (1, 1)
    assert at_t2["r0"].kv_usage == pytest.approx(10 / 32)
    assert (at_t2["r1"].running, at_t2["r1"].waiting, at_t2["r1"].kv_usage) == (0, 0, 0.0)


def test_imbalance_counts_requests_per_replica() -> None:
    router = Fixed(["r0", "r0", "r0", "r1"])
    requests = [req(float(i), range(i * 10, i * 10 + 4)) for i in range(4)]
    result = run(fleet(replicas=2), requests, router)
    assert result.requests_per_replica == {"r0": 3, "r1": 1}
    assert policy_stats("x", result, 0.0).imbalance == 1.5


def test_an_unknown_replica_from_the_router_is_an_error() -> None:
    with pytest.raises(SimulationError, match="unknown replica"):
        run(fleet(), [req(0.0, range(4))], Fixed(["nope"]))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SimulationError, match="capacity_blocks"):
        fleet(capacity_blocks=0)
    with pytest.raises(SimulationError, match="prefill_tps"):
        fleet(prefill_tps=0.0)


def test_single_cache_ceiling_is_one_lru_pool_of_the_fleets_capacity() -> None:
    # 2 replicas x 2 blocks = one pool of 4. A (2 blocks), B (2 blocks), A again: hit 4
    # tokens (its first block; the last block holds the last token); then C (4 blocks)
    # evicts everything; A misses.
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 216))
    requests = [req(0.0, a), req(1.0, b), req(2.0, a), req(3.0, c), req(4.0, a)]
    rate = single_cache_hit_rate(requests, fleet(replicas=2, capacity_blocks=2))
    assert rate == pytest.approx(4 / (8 * 4 + 16))
    # The ceiling evicts nothing: both repeats of A hit its first block.
    assert ceiling_hit_rate(requests, fleet(replicas=2, capacity_blocks=2)) == pytest.approx(
        8 / (8 * 4 + 16)
    )


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 5.0
    assert percentile(values, 90) == 9.0
    assert percentile(values, 99) == 10.0
    assert percentile([], 50) == 0.0


def test_the_ceiling_counts_cached_answers_as_a_replica_does() -> None:
    # As test_a_known_answer_is_cached_for_the_next_turn: turn 2 hits its 8 first tokens
    # (turn 1's prompt and answer), so the ceiling is 8 of 4 + 12 prompt tokens.
    q1, answer, q2 = list(range(4)), list(range(50, 54)), list(range(60, 64))
    turns = [req(0.0, q1, 4, output=answer), req(20.0, q1 + answer + q2, 1)]
    assert run(fleet(), turns, Fixed()).outcomes[1].hit_tokens == 8
    assert ceiling_hit_rate(turns, fleet()) == pytest.approx(8 / 16)
    assert single_cache_hit_rate(turns, fleet()) == pytest.approx(8 / 16)


def test_throughput_kv_usage_and_gpu_seconds_per_request() -> None:
    # r0: A (8 tokens, 2 s prefill, 2 output tokens: finishes at 4 s) and B at 10 s
    # (4 tokens, 1 s prefill, 1 output token: finishes at 12 s). r1: C at 0 s (4 tokens,
    # 1 s prefill, 3 output tokens: finishes at 4 s).
    requests = [req(0.0, range(8), 2), req(0.0, range(100, 104), 3), req(10.0, range(200, 204), 1)]
    result = run(fleet(replicas=2), requests, Fixed(["r0", "r1", "r0"]))
    stats = policy_stats("x", result, 0.0)
    assert stats.throughput_rps == pytest.approx(3 / 12)  # from 0 s to the last finish, 12 s
    assert stats.throughput_tps == pytest.approx((16 + 6) / 12)
    assert stats.output_tps == pytest.approx(6 / 12)
    # prefill 2 + 1 + 1 s; busy: r0 [0, 4] and [10, 12], r1 [0, 4] -> 10 s, 6 s decoding
    assert stats.prefill_gpu_s_per_request == pytest.approx(4 / 3)
    assert stats.gpu_s_per_request == pytest.approx(10 / 3)
    assert stats.decode_gpu_s_per_request == pytest.approx(6 / 3)
    # sampled at arrivals over both replicas: at 0 s twice (nothing held, then A's 3 of 8
    # blocks on r0), at 10 s (nothing held)
    assert result.kv_usage_samples == [0.0, 0.0, 3 / 8, 0.0, 0.0, 0.0]
    assert stats.kv_usage_mean == pytest.approx(3 / 8 / 6)
    assert stats.kv_usage_p90 == pytest.approx(3 / 8)


def test_a_decode_batch_costs_its_time_once() -> None:
    # Two requests decode together on one replica: 8 tokens then 4 (prefill 2 s + 1 s),
    # decodes end at 12 s and 13 s. Busy 13 s for both, not 2 x their decode times.
    requests = [req(0.0, range(8), 10), req(0.0, range(100, 104), 10)]
    stats = policy_stats("x", run(fleet(capacity_blocks=16), requests, Fixed()), 0.0)
    assert stats.gpu_s_per_request == pytest.approx(13 / 2)
    assert stats.prefill_gpu_s_per_request == pytest.approx(3 / 2)
