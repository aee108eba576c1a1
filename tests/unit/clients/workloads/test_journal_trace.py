"""A journal export as a trace: kept ids replayed, the rest of a prompt its own, receipts
without ids skipped and counted, arrivals from the receipts' times, bad files named."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvindex.api.schemas import ScoreEntry
from kvindex.clients.proxy.receipt import Receipt, packed_ids
from kvindex.clients.workloads.journal_trace import is_journal, read_journal
from kvindex.clients.workloads.trace import WorkloadError


def _receipt(
    request_id: str, at: float, ids: list[int] | None, num_tokens: int | None = None
) -> Receipt:
    candidates: list[ScoreEntry] = []
    return Receipt(
        id=request_id, time=at, route="/v1/completions", model="m",
        num_tokens=len(ids or []) if num_tokens is None else num_tokens, block_size=16,
        num_blocks=0, policy="kv_aware", weights={}, num_candidates=1, candidates=candidates,
        chosen="r1", status=200, duration_ms=1.0, max_tokens=9, session="s1",
        token_ids=None if ids is None else packed_ids(ids),
    )  # fmt: skip


def _write(path: Path, receipts: list[Receipt], *, as_array: bool = False) -> Path:
    if as_array:
        path.write_bytes(msgspec.json.encode(receipts))
    else:
        path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in receipts))
    return path


@pytest.mark.parametrize("as_array", [False, True])
def test_receipts_with_ids_replay_at_their_times(tmp_path: Path, as_array: bool) -> None:
    receipts = [
        _receipt("b", 105.0, [1, 2, 3]),
        _receipt("a", 100.0, [1, 2]),
        _receipt("c", 101.0, None),
        _receipt("d", 102.0, [], num_tokens=0),
    ]
    path = _write(tmp_path / "journal.jsonl", receipts, as_array=as_array)
    assert is_journal(path)
    trace = read_journal(path)
    assert trace.num_skipped == 2 and trace.block_sizes == {16}
    assert [(r.arrival_s, list(r.tokens())) for r in trace.requests] == [
        (0.0, [1, 2]),
        (5.0, [1, 2, 3]),
    ]
    assert trace.requests[0].output_length == 9 and trace.requests[0].session == "s1"


def test_the_rest_of_a_longer_prompt_is_its_own(tmp_path: Path) -> None:
    receipts = [_receipt(i, 0.0, [7] * 10, num_tokens=700) for i in ("a", "b")]
    trace = read_journal(_write(tmp_path / "j.jsonl", receipts))
    first, second = (list(r.tokens()) for r in trace.requests)
    assert len(first) == len(second) == 700
    assert first[:10] == second[:10] == [7] * 10 and first[10:] != second[10:]


def test_a_journal_without_ids_says_how_to_keep_them(tmp_path: Path) -> None:
    path = _write(tmp_path / "j.jsonl", [_receipt("a", 0.0, None)])
    with pytest.raises(WorkloadError, match="journal_token_bytes"):
        read_journal(path)


def test_a_request_log_is_not_a_journal_and_a_bad_line_is_named(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"model": "m", "prompt": "hi"}\n')
    assert not is_journal(log) and not is_journal(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(msgspec.json.encode(_receipt("a", 0.0, [1])) + b'\n{"receipt": 1}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: not a receipt"):
        read_journal(bad)
    odd = _receipt("a", 0.0, [1])
    odd.token_ids = "AAA="
    with pytest.raises(WorkloadError, match="u32"):
        read_journal(_write(tmp_path / "odd.jsonl", [odd]))
