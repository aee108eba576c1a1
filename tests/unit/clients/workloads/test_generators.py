"""kvindex.clients.workloads.generators."""

from __future__ import annotations

import itertools

import pytest

from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings, user_sessions
from kvindex.clients.workloads.trace import TraceRequest, WorkloadError


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_seeded_sized_and_sorted(name: str) -> None:
    settings = GeneratorSettings(requests=120, seed=3)
    first, again = WORKLOADS[name](settings), WORKLOADS[name](settings)
    other = WORKLOADS[name](GeneratorSettings(requests=120, seed=4))
    assert first == again
    assert first != other
    assert len(first) == 120
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)
    assert all(r.input_length == len(r.tokens()) > 0 for r in first)


def prefix_shared(requests: list[TraceRequest], tokens: int) -> float:
    """Share of requests whose first ``tokens`` tokens appeared in an earlier request."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for r in requests:
        head = tuple(r.tokens()[:tokens])
        hits += head in seen
        seen.add(head)
    return hits / len(requests)


def test_shared_workloads_share_prefixes_and_unique_does_not() -> None:
    settings = GeneratorSettings(requests=300, seed=1)
    for name in ("system_prompts", "multi_turn", "rag", "few_shot"):
        assert prefix_shared(WORKLOADS[name](settings), 256) > 0.5, name
    assert prefix_shared(WORKLOADS["unique"](settings), 16) == 0.0


def test_a_chat_turn_repeats_the_whole_history_with_the_answers() -> None:
    turns = [
        r for r in WORKLOADS["multi_turn"](GeneratorSettings(requests=60)) if r.session == "chat0"
    ]
    assert len(turns) >= 3
    for earlier, later in itertools.pairwise(turns):
        assert earlier.output is not None
        history = list(earlier.tokens()) + list(earlier.output)
        assert later.tokens()[: len(history)] == history


def test_generator_settings_are_checked() -> None:
    with pytest.raises(WorkloadError, match="requests"):
        GeneratorSettings(requests=0)
    with pytest.raises(WorkloadError, match="rate"):
        GeneratorSettings(rate=0.0)


@pytest.mark.parametrize("num_requests", [1, 7, 100])
def test_user_sessions_total_the_requests_and_depend_on_the_seed_alone(num_requests: int) -> None:
    sessions = user_sessions(num_requests, seed=3, vocab=1_000)
    assert sum(len(s.turns) for s in sessions) == num_requests
    assert sessions == user_sessions(num_requests, seed=3, vocab=1_000)
    assert sessions != user_sessions(num_requests, seed=4, vocab=1_000)
    tokens = [t for s in sessions for turn in [s.system, *s.turns] for t in turn]
    assert tokens and max(tokens) < 1_000
    assert {s.chat for s in user_sessions(200, seed=3)} == {True, False}
