"""Tokenizing in batches gives what tokenizing one request at a time gives."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import processors

from kvindex.clients.analyze import batches
from kvindex.clients.analyze.batches import tokenized_in_batches
from kvindex.clients.analyze.run import AnalyzeSettings, analyze_log
from kvindex.clients.workloads.request_log import (
    LogTokenizer,
    Problems,
    TokenizerOptions,
    read_request_log,
    tokenized,
)
from tests.support import request_logs as samples
from tests.support.request_logs import write_log

TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('no tool messages') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}<|assistant|>\n"
)


def mixed_rows() -> list[Any]:
    """Chats of every known structure, completions prompts (text and ids, and an empty one:
    its BOS alone), and lines that fail at each step: not JSON, no prompt, a template that
    refuses."""
    rows: list[Any] = [
        *samples.timestamped_rules(40),
        *samples.shared_system(30),
        *samples.multi_turn(num_chats=6, turns=4),
        *({"model": "m", "prompt": p} for p in samples.several_systems_texts(20)),
        {"model": "m", "prompt": [5, 6, 7, 8] * 10},
        {"model": "other", "prompt": [5, 6, 7, 8] * 10},
    ]
    random.Random(9).shuffle(rows)
    bad = ["{oops", {"model": "m"}, {"model": "m", "prompt": ""}]
    bad.append({"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    for i, row in enumerate(bad):
        rows.insert(7 + 23 * i, row)
    return rows


@pytest.fixture
def options(tokenizer_path: Path, tmp_path: Path) -> TokenizerOptions:
    """The test tokenizer with a BOS added to completions prompts (special tokens on),
    and a chat template that refuses tool messages."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    return TokenizerOptions(path=path, chat_template_path=template)


def report_json(log: Path, options: TokenizerOptions, **kw: Any) -> dict[str, Any]:
    report = asyncio.run(analyze_log(log, AnalyzeSettings(options, **kw)))
    data = report.to_json()
    del data["wall_s"], data["timings"]
    return data


@pytest.mark.parametrize("batch", [64, 5])
def test_the_report_is_the_same_in_batches_as_one_at_a_time(
    options: TokenizerOptions, tmp_path: Path, batch: int
) -> None:
    log = write_log(tmp_path / "log.jsonl", mixed_rows())
    one_at_a_time = report_json(log, options, tokenize_batch=1)
    assert one_at_a_time["num_problems"] == 3
    assert one_at_a_time["fragmentation"] and one_at_a_time["top_prefixes"]
    assert report_json(log, options, tokenize_batch=batch) == one_at_a_time


def tokens_of(log: Path, options: TokenizerOptions, batch: int | None) -> tuple[Any, list[str]]:
    async def go() -> list[tuple[int, list[int]]]:
        async with LogTokenizer(options) as tok:
            requests = read_request_log(log, problems)
            if batch is None:
                stream = tokenized(requests, tok, problems)
            else:
                stream = tokenized_in_batches(requests, tok, problems, batch_size=batch)
            return [(t.request.line, t.tokens) async for t in stream]

    problems = Problems()
    done = asyncio.run(go())
    return done, sorted(str(p) for p in problems.kept)


def test_every_request_has_the_same_token_ids(options: TokenizerOptions, tmp_path: Path) -> None:
    log = write_log(tmp_path / "log.jsonl", mixed_rows())
    expected = tokens_of(log, options, None)
    assert len(expected[0]) > 100 and len(expected[1]) == 3
    assert tokens_of(log, options, 16) == expected


def test_a_batch_the_library_rejects_is_tokenized_one_at_a_time(
    options: TokenizerOptions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = write_log(tmp_path / "log.jsonl", mixed_rows())
    expected = tokens_of(log, options, None)

    def rejected(*_: object) -> list[list[int]]:
        raise Exception("the binding's bare error")  # what the Rust binding raises

    monkeypatch.setattr(batches, "_encode", rejected)
    assert tokens_of(log, options, 16) == expected


def test_the_limit_reads_no_line_past_the_last_request(
    options: TokenizerOptions, tmp_path: Path
) -> None:
    rows: list[Any] = [*samples.shared_system(10), "{oops"]
    log = write_log(tmp_path / "log.jsonl", rows)
    report = asyncio.run(analyze_log(log, AnalyzeSettings(options, limit=10)))
    assert (report.num_requests, report.num_problems) == (10, 0)
    report = asyncio.run(analyze_log(log, AnalyzeSettings(options, limit=11)))
    assert (report.num_requests, report.num_problems) == (10, 1)
