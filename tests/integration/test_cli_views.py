"""The ``kvindex`` operator views (clients/cli/views.py) against the real API app.

The app is served by uvicorn on a free loopback port over the fleet of
``test_client_http`` (r1 holds 4 blocks of the request, r2 2) and stopped after each test;
each command is driven with click's CliRunner (stdout is not a TTY: plain text).
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision.routing_rules import RoutingRule
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import ReplicaView, ScoreResponse
from kvindex.clients.cli.main import main
from kvindex.clients.http import KvIndexClient
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from tests.integration.test_client_http import (
    BLOCK,
    MODEL,
    PREFIX,
    REQUEST,
    TOKEN,
    seed,
    serving,
)


@pytest.fixture
def base_url() -> Iterator[str]:
    with serving() as served:
        yield served.base_url


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(REQUEST))
    return path


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def score_args(base_url: str, tokens_file: Path, *extra: str) -> list[str]:
    return ["--url", base_url, "--model", MODEL, "--tokens-file", str(tokens_file), *extra]


def row(output: str, replica: str) -> str:
    """The table row of ``replica`` (not the heading, which names the best replica too):
    the line that starts with its id (after the ``★`` of the best, or two spaces)."""
    return next(line for line in output.splitlines() if line.lstrip("★ ").startswith(replica))


def on_terminal(columns: int) -> dict[str, str]:
    """The environment under which rich takes stdout for a terminal ``columns`` wide."""
    return {"TTY_COMPATIBLE": "1", "COLUMNS": str(columns), "NO_COLOR": "1"}


def matched(answer: ScoreResponse) -> dict[str, int]:
    return {entry.replica: entry.matched_blocks for entry in answer.scores}


# --- residency ------------------------------------------------------------------------------


def test_residency_json_is_the_score_response(base_url: str, tokens_file: Path) -> None:
    result = run("residency", *score_args(base_url, tokens_file, "--json"))
    assert result.exit_code == 0, result.output
    answer = msgspec.json.decode(result.stdout, type=ScoreResponse)
    assert (answer.best, answer.num_blocks, answer.block_size) == ("r1", 6, BLOCK)
    assert matched(answer) == {"r1": 4, "r2": 2}


def test_residency_table_marks_the_best_and_draws_strips(base_url: str, tokens_file: Path) -> None:
    result = run("residency", *score_args(base_url, tokens_file))
    assert result.exit_code == 0, result.output
    r1, r2 = row(result.stdout, "r1"), row(result.stdout, "r2")
    assert "★ r1" in r1 and "★" not in r2
    assert "████··" in r1 and "4/6" in r1 and f"{4 * BLOCK}/{len(REQUEST)}" in r1
    assert "██····" in r2 and "2/6" in r2
    assert "best r1" in result.stdout
    assert "1 cell = 1 block" in result.stdout
    assert "\x1b[" not in result.stdout  # not a TTY: no colour codes


def test_residency_groups_blocks_of_a_long_prompt(base_url: str, tmp_path: Path) -> None:
    long_prompt = PREFIX + [(31 * i + 3) % 150_000 for i in range(20 * BLOCK)]  # 24 blocks
    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(map(str, long_prompt)))  # the whitespace-separated form
    result = run("residency", *score_args(base_url, path, "--width", "8"))
    assert result.exit_code == 0, result.output
    assert "1 cell = 3 blocks" in result.stdout
    r1 = row(result.stdout, "r1")
    assert "█▌······" in r1 and "4/24" in r1


def test_residency_candidates(base_url: str, tokens_file: Path) -> None:
    result = run("residency", *score_args(base_url, tokens_file, "--candidates", "r2", "--json"))
    assert result.exit_code == 0, result.output
    answer = msgspec.json.decode(result.stdout, type=ScoreResponse)
    assert (answer.best, matched(answer)) == ("r2", {"r2": 2})


@pytest.mark.parametrize("command", ["residency", "score"])
def test_top_k_shows_the_best_and_says_how_many_are_left_out(
    base_url: str, tokens_file: Path, command: str
) -> None:
    result = run(command, *score_args(base_url, tokens_file, "--top-k", "1"))
    assert result.exit_code == 0, result.output
    assert "★ r1" in row(result.stdout, "r1")
    assert not any(line.lstrip("★ ").startswith("r2") for line in result.stdout.splitlines())
    assert "top 1 of 2 candidates (2 matched; --top-k 0 for all)" in result.stdout
    every = run(command, *score_args(base_url, tokens_file, "--top-k", "0", "--json"))
    answer = msgspec.json.decode(every.stdout, type=ScoreResponse)
    assert (matched(answer), answer.num_candidates) == ({"r1": 4, "r2": 2}, 2)
    refused = run(command, *score_args(base_url, tokens_file, "--top-k", "-1"))
    assert refused.exit_code == 2 and "--top-k" in refused.output


# --- score ----------------------------------------------------------------------------------


def test_score_wide_shows_every_term(base_url: str, tokens_file: Path) -> None:
    result = run("score", *score_args(base_url, tokens_file, "--wide"))
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "replica" in line)
    for column in ("cache", "freshness_factor", "load", "load_recency", "score"):
        assert column in header
    assert "★ r1" in result.stdout and "policy kv_aware" in result.stdout
    assert "0.6667" in row(result.stdout, "r1")  # r1's cache term: 4 of 6 blocks on GPU


def test_score_says_why_the_best_won_a_tie(base_url: str, tmp_path: Path) -> None:
    """Both replicas hold the prompt's two blocks and report no load: a tie at score 1,
    broken by chance, and the heading says so."""
    path = tmp_path / "two_blocks.json"
    path.write_text(json.dumps(PREFIX[: 2 * BLOCK]))
    result = run("score", *score_args(base_url, path))
    assert result.exit_code == 0, result.output
    best, other = ("r1", "r2") if "★ r1" in result.stdout else ("r2", "r1")
    heading = " ".join(result.stdout.split())
    assert f"tie at score 1 ({best}, {other}): same load: {best} drawn by chance" in heading


def test_score_at_100_columns_is_one_line_per_candidate(base_url: str, tokens_file: Path) -> None:
    with KvIndexClient(base_url) as client:  # a load with a routed count: the widest cell
        client.report_load("r1", running=3, waiting=1, kv_usage=0.5)
    result = run("score", *score_args(base_url, tokens_file), env=on_terminal(100))
    assert result.exit_code == 0, result.output
    lines = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout).splitlines()
    assert max(len(line) for line in lines) <= 100
    body = lines[next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1 :]
    assert [line.lstrip("★ ").split()[0] for line in body] == ["r1", "r2"]
    r1 = row("\n".join(body), "r1")
    assert f"4 blk / {4 * BLOCK} tok" in r1 and "live" in r1 and "run 3 wait 1 kv 50%" in r1
    assert "freshness_factor" not in result.stdout  # the terms are --wide's


def test_piped_views_print_whole_values(base_url: str, tokens_file: Path) -> None:
    with KvIndexClient(base_url) as client:
        client.report_load("r2", running=12, waiting=30, kv_usage=0.97)
    outputs = {
        "residency": run("residency", *score_args(base_url, tokens_file, "--wide")),
        "score": run("score", *score_args(base_url, tokens_file, "--wide")),
        "replicas": run("replicas", "--url", base_url, "--wide"),
        "stats": run("stats", "--url", base_url),
    }
    for name, result in outputs.items():
        assert result.exit_code == 0, (name, result.output)
        assert "…" not in result.stdout, name
    load = "run 12 wait 30 kv 97% ("  # the whole load, age and source included
    for name in ("residency", "score", "replicas"):
        assert load in row(outputs[name].stdout, "r2"), name


def test_score_json_with_a_policy(base_url: str, tokens_file: Path) -> None:
    result = run("score", *score_args(base_url, tokens_file, "--policy", "least_load", "--json"))
    assert result.exit_code == 0, result.output
    answer = msgspec.json.decode(result.stdout, type=ScoreResponse)
    assert answer.policy == "least_load"
    assert matched(answer) == {"r1": 4, "r2": 2}


def test_score_names_the_routing_rule_a_workload_matched(tokens_file: Path) -> None:
    """``--workload`` reaches the API's ``[[rules]]``; the heading and the JSON name the rule."""
    index, registry = MemoryIndex(), Registry((ReplicaSpec("r1", MODEL), ReplicaSpec("r2", MODEL)))
    seed(index, registry)
    batch = RoutingRule("batch", workload=("batch",), policy="least_load")
    settings = ApiSettings(scrape_interval_s=0, seed=7, rules=(batch,))
    deps = ApiDeps(settings, index, registry, MemoryLoadStore(), blocking_store=False)
    server = BackgroundServer(create_app(deps), lifespan="on").start()
    try:
        args = score_args(server.base_url, tokens_file)
        ruled = run("score", *args, "--workload", "batch")
        plain = run("score", *args, "--json")
    finally:
        server.stop()
    assert ruled.exit_code == 0, ruled.output
    assert "policy least_load (rule batch)" in ruled.stdout.splitlines()[0]
    answer = msgspec.json.decode(plain.stdout, type=ScoreResponse)
    assert (answer.rule, answer.policy) == (None, "kv_aware")


def test_operator_views_change_no_routing(base_url: str, tokens_file: Path) -> None:
    """score and residency are dry runs: asked again and again, the same best replica, and
    nothing counted as load toward it."""
    with KvIndexClient(base_url) as client:
        client.report_load("r1", running=0, waiting=0)
        client.report_load("r2", running=0, waiting=0)
    args = score_args(base_url, tokens_file, "--policy", "round_robin", "--json")
    answers = [msgspec.json.decode(run("score", *args).stdout, type=ScoreResponse) for _ in "abc"]
    assert run("residency", *score_args(base_url, tokens_file)).exit_code == 0
    assert len({a.best for a in answers}) == 1
    again = msgspec.json.decode(run("score", *args).stdout, type=ScoreResponse)
    assert again.best == answers[0].best
    assert all(e.load is not None and e.load.routed == 0 for e in again.scores)


# --- replicas and stats -----------------------------------------------------------------------


def test_replicas_table_and_json(base_url: str) -> None:
    with KvIndexClient(base_url) as client:
        client.report_load("r1", running=3, waiting=1, kv_usage=0.5)
    table = run("replicas", "--url", base_url)
    assert table.exit_code == 0, table.output
    assert "demo-model · 2 replicas" in table.stdout.splitlines()
    r1 = row(table.stdout, "r1")
    assert "live" in r1 and "0: seq 0, 4/0/0" in r1
    assert "run 3 wait 1 kv 50%" in r1
    as_json = run("replicas", "--url", base_url, "--json")
    assert as_json.exit_code == 0, as_json.output
    views = msgspec.json.decode(as_json.stdout, type=list[ReplicaView])
    assert [(v.id, v.streams[0].blocks["gpu"]) for v in views] == [("r1", 4), ("r2", 5)]


def test_stats_table_and_json(base_url: str) -> None:
    table = run("stats", "--url", base_url)
    assert table.exit_code == 0, table.output
    assert "gpu 9 · cpu 0 · other 0" in table.stdout
    as_json = run("stats", "--url", base_url, "--json")
    assert as_json.exit_code == 0, as_json.output
    totals = json.loads(as_json.stdout)
    assert (totals["replicas"], totals["streams"], totals["blocks"]["gpu"]) == (2, 2, 9)


# --- errors ---------------------------------------------------------------------------------


def test_unknown_model_gives_the_servers_message(base_url: str, tokens_file: Path) -> None:
    args = ["--url", base_url, "--model", "other-model", "--tokens-file", str(tokens_file)]
    for command in ("residency", "score"):
        result = run(command, *args)
        assert result.exit_code == 1
        assert "unknown_model (HTTP 404)" in result.output
        assert "known models: ['demo-model']" in result.output
        assert "Traceback" not in result.output


def test_messages_without_a_tokenizer(base_url: str, tmp_path: Path) -> None:
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": "hello"}]))
    result = run("residency", "--url", base_url, "--model", MODEL, "--messages-file", str(path))
    assert result.exit_code == 1
    assert "invalid_request (HTTP 422)" in result.output and "no tokenizer" in result.output


def test_prompt_source_is_checked_locally(tokens_file: Path, tmp_path: Path) -> None:
    both = run("score", "--model", MODEL, "--text", "hi", "--tokens-file", str(tokens_file))
    assert both.exit_code == 2 and "exactly one of" in both.output
    bad = tmp_path / "bad.json"
    bad.write_text('["a", "b"]')
    result = run("score", "--model", MODEL, "--tokens-file", str(bad))
    assert result.exit_code == 2 and "not a list of token ids" in result.output


def test_unreachable_server(tokens_file: Path) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        for args in (["stats"], ["replicas"], ["residency", "--model", MODEL]):
            extra = ["--tokens-file", str(tokens_file)] if args[0] == "residency" else []
            result = run(*args, "--url", url, *extra)
            assert result.exit_code == 1
            assert f"cannot reach kvindex at {url}" in result.output
            assert "ConnectError" in result.output and "Traceback" not in result.output


def test_auth_token_is_passed_through(tokens_file: Path) -> None:
    with serving(auth_token=TOKEN) as served:
        anonymous = run("stats", "--url", served.base_url)
        assert anonymous.exit_code == 1 and "unauthorized (HTTP 401)" in anonymous.output
        wrong = run("replicas", "--url", served.base_url, "--token", "wrong")
        assert wrong.exit_code == 1 and "unauthorized" in wrong.output
        flag = run("residency", *score_args(served.base_url, tokens_file, "--token", TOKEN))
        assert flag.exit_code == 0 and "★ r1" in flag.stdout
        env = {"KVINDEX_URL": served.base_url, "KVINDEX_API_TOKEN": TOKEN}
        from_env = run("stats", "--json", env=env)
        assert from_env.exit_code == 0, from_env.output
        assert json.loads(from_env.stdout)["replicas"] == 2
