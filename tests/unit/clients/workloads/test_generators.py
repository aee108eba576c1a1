from __future__ import annotations

import gzip
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvindex.clients.workloads.generators import (
    CHAT_VOCAB,
    DEFAULT_LOG_RATE,
    DEFAULT_OUTPUT_TOKENS,
    MAX_CHAT_TOKENS,
    TRACE_BLOCK_TOKENS,
    WORKLOADS,
    ChatSessions,
    GeneratorSettings,
    TraceRequest,
    WorkloadError,
    block_tokens,
    chat_system_prompts,
    logged_trace,
    read_trace,
    trace_sessions,
    trace_tokens,
    user_sessions,
)
from kvindex.clients.workloads.request_log import LoggedRequest, TokenizedRequest
from tests.support.paths import MOONCAKE_TRACE

MOONCAKE = MOONCAKE_TRACE


def write_trace(path: Path, rows: Sequence[object], *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


ROWS = [
    {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
]


@pytest.mark.parametrize("gz", [False, True])
def test_a_mooncake_trace_reads_plain_or_gzip_sorted_by_arrival(tmp_path: Path, gz: bool) -> None:
    path = write_trace(tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), ROWS, gz=gz)
    first, second = read_trace(path)
    assert (first.arrival_s, first.input_length, first.output_length) == (0.0, 600, 7)
    assert (second.arrival_s, second.hash_ids, second.session) == (1.5, (0, 1), "b0")


def test_equal_block_ids_give_equal_tokens_and_the_last_block_is_cut(tmp_path: Path) -> None:
    a, b = read_trace(write_trace(tmp_path / "t.jsonl", ROWS))
    ta, tb = a.tokens(), b.tokens()
    assert (len(ta), len(tb)) == (600, 700)
    assert ta[:TRACE_BLOCK_TOKENS] == tb[:TRACE_BLOCK_TOKENS]  # block id 0 shared
    assert ta[TRACE_BLOCK_TOKENS:] != tb[TRACE_BLOCK_TOKENS : TRACE_BLOCK_TOKENS + 88]
    assert tb[TRACE_BLOCK_TOKENS:] == block_tokens(1, 700 - TRACE_BLOCK_TOKENS)
    assert block_tokens(1, 10) == block_tokens(1)[:10]
    assert all(0 <= t < 65_536 for t in ta)


def test_trace_tokens_is_deterministic_and_ids_differ() -> None:
    assert trace_tokens([7, 8], 1024) == trace_tokens([7, 8], 1024)
    assert block_tokens(7) != block_tokens(8)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:2"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "cover 512"),
        ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ],
)
def test_a_bad_trace_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(WorkloadError, match=message):
        read_trace(path)


def test_an_empty_or_missing_trace_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(WorkloadError, match="missing"):
        read_trace(tmp_path / "missing.jsonl")


def test_limit_reads_the_first_rows(tmp_path: Path) -> None:
    assert len(read_trace(write_trace(tmp_path / "t.jsonl", ROWS), limit=1)) == 1


def test_the_shared_mooncake_trace_reads_whole() -> None:
    requests = read_trace(MOONCAKE)
    assert len(requests) == 3993
    assert requests[-1].arrival_s == pytest.approx(1022.025)


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


def chat_sessions(seed: int = 0, max_idle: int = 8) -> ChatSessions:
    return ChatSessions(random.Random(seed), chat_system_prompts(seed, 3), max_idle=max_idle)


def test_chat_system_prompts_are_seeded_and_tens_of_blocks_long() -> None:
    prompts = chat_system_prompts(0, 3)
    assert prompts == chat_system_prompts(0, 3) != chat_system_prompts(1, 3)
    assert all(20 * 16 <= len(p) < 61 * 16 for p in prompts)
    assert all(0 <= t < CHAT_VOCAB for p in prompts for t in p)


def test_a_chat_comes_back_with_its_whole_history_until_it_is_done() -> None:
    sessions = chat_sessions(max_idle=1)  # one idle chat is always picked next
    turn = sessions.next_turn()
    assert turn.tokens[: len(turn.chat.tokens)] == turn.chat.tokens  # the history, then more
    turns = 1
    while sessions.end_turn(turn):
        history = turn.tokens
        turn = sessions.next_turn()
        assert turn.tokens[: len(history)] == history  # the same chat, answers included
        assert turn.num_prompt_tokens > len(history)
        turns += 1
    assert turns <= 8
    assert turn.chat.turns_left == 0 or len(turn.tokens) >= MAX_CHAT_TOKENS
    assert sessions.next_turn().chat is not turn.chat  # a finished chat never comes back


def test_chat_sessions_are_a_function_of_the_seed() -> None:
    def tokens(seed: int) -> list[list[int]]:
        sessions = chat_sessions(seed)
        out = []
        for _ in range(20):
            turn = sessions.next_turn()
            sessions.end_turn(turn)
            out.append(turn.tokens)
        return out

    assert tokens(3) == tokens(3) != tokens(4)


@pytest.mark.parametrize("num_requests", [1, 7, 100])
def test_user_sessions_total_the_requests_and_depend_on_the_seed_alone(num_requests: int) -> None:
    sessions = user_sessions(num_requests, seed=3, vocab=1_000)
    assert sum(len(s.turns) for s in sessions) == num_requests
    assert sessions == user_sessions(num_requests, seed=3, vocab=1_000)
    assert sessions != user_sessions(num_requests, seed=4, vocab=1_000)
    tokens = [t for s in sessions for turn in [s.system, *s.turns] for t in turn]
    assert tokens and max(tokens) < 1_000
    assert {s.chat for s in user_sessions(200, seed=3)} == {True, False}


def test_requests_sharing_only_a_system_prompt_get_sessions_of_their_own() -> None:
    # 40 requests behind the same 2-block system prompt (ids 0, 1), each its own question.
    traces = [[0, 1, 100 + i, 1000 + i] for i in range(40)]
    assert trace_sessions(traces) == [f"b{100 + i}" for i in range(40)]


def test_a_chat_keeps_its_session_across_turns_behind_a_shared_prompt() -> None:
    others = [[0, 100 + i, 1000 + i] for i in range(10)]
    chat = [[0, 7, 70], [0, 7, 71, 72, 73], [0, 7, 71, 72, 74, 75]]  # each turn extends
    sessions = trace_sessions([*others, *chat])
    assert sessions[10:] == ["b7", "b7", "b7"]
    assert len(set(sessions[:10])) == 10


def test_a_document_a_few_questions_share_stays_one_session() -> None:
    # 800 requests behind system prompt 0: a block needs 8 continuations (1 %) to count as
    # shared; document 5 has 4 questions, so its questions stay together.
    everyone = [[0, 100 + i, 2000 + i] for i in range(796)]
    document = [[0, 5, 50 + q] for q in range(4)]
    sessions = trace_sessions([*everyone, *document])
    assert sessions[796:] == ["b5"] * 4
    assert len(set(sessions[:796])) == 796


def test_a_request_that_is_all_shared_prefix_is_keyed_by_its_last_block() -> None:
    traces = [[0, 1, 100 + i] for i in range(8)] + [[0, 1]]
    assert trace_sessions(traces)[-1] == "b1"


def test_read_trace_derives_sessions_past_the_shared_first_block(tmp_path: Path) -> None:
    rows = [
        {"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [0, 10 + i]}
        for i in range(8)
    ]
    requests = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert [r.session for r in requests] == [f"b{10 + i}" for i in range(8)]


# --- request logs ----------------------------------------------------------------------------


def _logged(
    stamps: Sequence[float | None], max_tokens: int | None = None
) -> list[TokenizedRequest]:
    return [
        TokenizedRequest(
            LoggedRequest(i + 1, "m", prompt="p", timestamp_s=t, max_tokens=max_tokens),
            [i + 1] * 40,
        )
        for i, t in enumerate(stamps)
    ]


def test_a_logged_trace_arrives_at_its_timestamps_sorted() -> None:
    trace = logged_trace(_logged([1_000.5, 1_000.0, 1_002.0]))
    assert [r.arrival_s for r in trace] == [0.0, 0.5, 2.0]
    assert [r.tokens()[0] for r in trace] == [2, 1, 3]
    assert all(r.output_length == DEFAULT_OUTPUT_TOKENS for r in trace)
    assert [r.session for r in trace] == ["line:2", "line:1", "line:3"]


def test_a_logged_trace_without_every_timestamp_or_with_a_rate_is_poisson() -> None:
    trace = logged_trace(_logged([1.0, None] * 200, max_tokens=9), seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / DEFAULT_LOG_RATE, rel=0.3)
    assert trace[0].output_length == 9 and trace[0].input_length == 40
    fast = logged_trace(_logged([1.0] * 400), rate=1000.0)
    assert fast[-1].arrival_s < 1.0


def test_a_logged_trace_needs_requests_and_a_positive_rate() -> None:
    with pytest.raises(WorkloadError, match="no usable request"):
        logged_trace([])
    with pytest.raises(WorkloadError, match="rate"):
        logged_trace(_logged([1.0]), rate=0.0)
