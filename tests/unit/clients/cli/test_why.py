"""``kvindex why``: a receipt drawn in words (each outcome explained), the command's usage
and its one-line errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvindex.api.schemas import FreshnessView, LoadView, ScoreEntry
from kvindex.clients.cli.main import main
from kvindex.clients.cli.render import render_receipt
from kvindex.clients.proxy.receipt import Receipt
from tests.support.redis_server import free_port


def _receipt(**changes: object) -> Receipt:
    entry = ScoreEntry(
        replica="r2", rank=0, matched_blocks=3, matched_tokens=48, tiers={"gpu": 3},
        load=LoadView(1, 0, 0.25, 0.5, "scrape"), freshness=FreshnessView("live", 0.01, 0.2),
        terms={"cache": 0.75, "load": -0.02}, score=0.73,
    )  # fmt: skip
    receipt = Receipt(
        id="req-7", time=1_800_000_000.0, route="/v1/chat/completions", model="m",
        num_tokens=64, block_size=16, num_blocks=4, policy="kv_aware", weights={"cache": 1.0},
        num_candidates=3, candidates=[entry], chosen="r2", fallbacks=["r1"], answered_by="r2",
        retries=0, predicted_tokens=48, prompt_tokens=64, cached_tokens=48, outcome="exact",
        error_tokens=0, status=200, ttfb_ms=3.25, duration_ms=12.5,
    )  # fmt: skip
    for name, value in changes.items():
        setattr(receipt, name, value)
    return receipt


def _text(receipt: Receipt) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(*render_receipt(receipt))
    return console.export_text()


def test_a_receipt_in_words() -> None:
    text = _text(_receipt())
    for words in (
        "request req-7 · /v1/chat/completions · m · 64 tokens · 4 blocks of 16 · policy kv_aware",
        "chose r2 of 3 candidates (then r1); answered by r2 · status 200 · first byte 3.2 ms",
        "top 1 of 3 candidates",
        "★ r2",
        "0.75",
        "the index matched 48 tokens on r2; the engine reported 48 of 64 cached",
        "outcome: exact: the index was right",
    ):
        assert words in text, words


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"outcome": "over_predicted", "error_tokens": 16}, "credited 16 tokens"),
        ({"outcome": "under_predicted", "error_tokens": -32}, "had 32 more tokens"),
        ({"outcome": "token_mismatch", "prompt_tokens": 70}, "counted 70 prompt tokens"),
        ({"outcome": "unreported", "cached_tokens": None}, "--enable-prompt-tokens-details"),
        ({"outcome": None}, "not compared"),
        ({"predicted_tokens": None, "answered_by": None, "status": 502}, "no replica answered"),
        ({"retries": 1, "answered_by": "r1"}, "answered by r1 after 1 retry"),
        ({"unhealthy": {"r3": "ejected"}}, "left out, unhealthy: r3 (ejected)"),
        ({"untokenized": True}, "ranked on load alone"),
        ({"head": True}, "chosen on the prompt's head"),
    ],
)
def test_each_outcome_and_detail_is_said(changes: dict[str, object], words: str) -> None:
    assert words in _text(_receipt(**changes))


def test_the_command_wants_an_id_or_an_export(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["why"])
    assert result.exit_code == 2 and "a request id, or --export FILE" in result.output
    both = runner.invoke(main, ["why", "x", "--export", str(tmp_path / "j.jsonl")])
    assert both.exit_code == 2


def test_an_unreachable_proxy_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["why", "x", "--proxy", url])
    assert result.exit_code == 1 and f"cannot reach the proxy at {url}" in result.output
