"""SGLang 0.5.23's own ``ZmqEventPublisher`` and ``KVCacheEventRecorder`` (CPU only, in the
venv ``make sglang-venv`` makes) publishing into ``kvindex serve``: two DP ranks on SGLang's
port offsets, plain, salted and LoRA prefixes matched by ``/score``, removals and a clear."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import consecutive_free_ports
from tests.support.paths import ROOT
from tests.support.processes import running
from tests.support.redis_server import free_port

SGLANG_PYTHON = ROOT / ".venv-sglang/bin/python"
ENGINE = ROOT / "tests/support/sglang_engine.py"
MODEL = "demo-model"
PAGE = 32
SALT = "tenant-a"
LORA = "sql-lora"

pytestmark = pytest.mark.timeout(60)


class SGLangEngine:
    """The engine script's stdin/stdout: one JSON command, one ``ok``."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.ticks = 0

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        assert answer == "ok", f"SGLang engine answered {answer!r} to {command}"

    def quit(self) -> None:
        """Ask the engine to shut its publishers down and end; end it anyway after 10 s."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write('{"op": "quit"}\n')
            self.process.stdin.close()
            self.process.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(5)

    def batch(self, **command: Any) -> None:
        """One command, then the end of a scheduler step (its events as one batch)."""
        self.send(**command)
        self.send(op="step")

    def tick(self) -> None:
        """A throwaway store per rank: a later seq, so a batch lost to the slow joiner is
        seen as a gap and replayed."""
        self.ticks += 1
        for rank in (0, 1):
            tokens = list(range(900_000 + PAGE * self.ticks, 900_000 + PAGE * (self.ticks + 1)))
            self.send(op="store", rank=rank, node=f"tick-{self.ticks}", tokens=tokens)
        self.send(op="step")


@pytest.fixture
def sglang(tmp_path: Path) -> Iterator[tuple[SGLangEngine, str, str]]:
    """(the engine, its rank-0 events endpoint, its rank-0 replay endpoint)."""
    if not (ROOT / ".venv-sglang/.installed").exists():
        pytest.skip("no .venv-sglang: `make sglang-venv` could not install sglang 0.5.23")
    events, replay = consecutive_free_ports(2), consecutive_free_ports(2)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": f"kv@sgl@{MODEL}",
        "bind": True,
        "dp_size": 2,
        "page_size": PAGE,
    }
    with (tmp_path / "sglang.log").open("w") as log:
        process = subprocess.Popen(
            [str(SGLANG_PYTHON), str(ENGINE), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        engine = SGLangEngine(process)
        try:
            assert process.stdout is not None
            ready = process.stdout.readline().strip()
            assert ready == "ready", (tmp_path / "sglang.log").read_text()
            yield engine, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"
        finally:
            engine.quit()
            assert process.stdout is not None
            process.stdout.close()


def _pages(start: int, count: int) -> list[int]:
    return list(range(start, start + count * PAGE))


def _store_prefixes(engine: SGLangEngine, rank: int) -> dict[str, list[int]]:
    """Plain, salted and LoRA chains, and one store removed again; their prompts."""
    base = 1000 + 100_000 * rank
    stores = [
        ("plain", None, _pages(base, 2), {}),
        ("child", "plain", _pages(base + 5000, 1), {}),
        ("salted", None, _pages(base, 2), {"cache_salt": SALT}),
        ("salted-child", "salted", _pages(base + 7000, 1), {"cache_salt": SALT}),
        ("lora", None, _pages(base + 20_000, 3), {"lora_name": LORA, "lora_id": f"{rank:032x}"}),
        ("gone", None, _pages(base + 30_000, 1), {}),
    ]
    for node, parent, tokens, extras in stores:
        engine.batch(op="store", rank=rank, node=node, parent=parent, tokens=tokens, **extras)
    engine.batch(op="remove", rank=rank, node="gone")
    return {
        "plain": _pages(base, 2) + _pages(base + 5000, 1),
        "salted": _pages(base, 2) + _pages(base + 7000, 1),
        "lora": _pages(base + 20_000, 3),
        "gone": _pages(base + 30_000, 1),
    }


def _matched(http: httpx.Client, tokens: list[int], **extras: str) -> tuple[int, int] | None:
    """Replica ``sgl``'s best match: (its DP rank, matched blocks); /score answers one entry
    per replica, the rank holding the longest prefix."""
    body = {"model": MODEL, "token_ids": tokens, "top_k": 0, "dry_run": True, **extras}
    answer = http.post("/score", json=body)
    if answer.status_code != 200:
        return None
    scores = answer.json()["scores"]
    found = [(s["rank"], s["matched_blocks"]) for s in scores if s["replica"] == "sgl"]
    return found[0] if found else None


def _until(
    engine: SGLangEngine, check: Callable[[], bool], seen: object = None, timeout_s: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout_s
    next_tick = time.monotonic() + 2.0
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"kvindex never showed SGLang's events; last seen: {seen}")
        if time.monotonic() > next_tick:
            engine.tick()
            next_tick = time.monotonic() + 2.0
        time.sleep(0.1)


def test_sglangs_own_publisher_into_kvindex_serve(
    sglang: tuple[SGLangEngine, str, str], tmp_path: Path
) -> None:
    engine, events, replay = sglang
    port = free_port()
    replica = f"id=sgl,model={MODEL},events={events},replay={replay},dp_size=2"
    with (
        running(tmp_path / "serve.log", "serve", "--replica", replica, "--port", str(port)),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5) as http,
    ):
        _until(engine, lambda: _healthy(http))
        prompts = [_store_prefixes(engine, rank) for rank in (0, 1)]
        last_seen: list[object] = []  # what the last failed check saw, for the message

        def expect(phase: dict[int, dict[str, int]]) -> Callable[[], bool]:
            def check() -> bool:
                for rank, prompt in enumerate(prompts):
                    want = phase[rank]
                    got = {
                        "plain": _matched(http, prompt["plain"]),
                        "salted": _matched(http, prompt["salted"], cache_salt=SALT),
                        "other-salt": _matched(http, prompt["salted"], cache_salt="tenant-b"),
                        "lora": _matched(http, prompt["lora"], lora_name=LORA),
                        "no-lora": _matched(http, prompt["lora"]),
                        "gone": _matched(http, prompt["gone"]),
                    }
                    # Each rank's prompts are its own: the other rank never holds them.
                    if any(
                        g is None or g[1] != want[k] or (want[k] and g[0] != rank)
                        for k, g in got.items()
                    ):
                        last_seen[:] = [rank, got]
                        return False
                return True

            return check

        stored = {"plain": 3, "salted": 3, "other-salt": 0, "lora": 3, "no-lora": 0, "gone": 0}
        _until(engine, expect({0: stored, 1: stored}), last_seen)
        engine.batch(op="remove", rank=0, node="child")  # rank 0 drops its third plain page
        engine.batch(op="clear", rank=1)  # rank 1 clears everything
        cleared = dict.fromkeys(stored, 0)
        _until(engine, expect({0: {**stored, "plain": 2}, 1: cleared}), last_seen)
        answer = http.post("/score", json={"model": MODEL, "token_ids": prompts[0]["plain"]})
        assert answer.json()["block_size"] == PAGE  # SGLang's page size, learned from events


def _healthy(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False
