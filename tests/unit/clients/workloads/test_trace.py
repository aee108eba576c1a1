"""kvindex.clients.workloads.trace: Mooncake traces and their sessions."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvindex.clients.workloads.trace import (
    TRACE_BLOCK_TOKENS,
    WorkloadError,
    block_tokens,
    read_trace,
    trace_sessions,
    trace_tokens,
)
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
