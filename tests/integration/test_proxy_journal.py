"""The route journal through real processes: three ``kvindex replica-sim``s behind ``kvindex
proxy`` (free loopback ports). ``kvindex why <id>`` explains a request sent through the proxy
(candidates, terms, outcome); the memory journal holds its bound however many requests
pass; hostile ids and limits are 4xx; an export replays through ``kvindex simulate
--requests``."""

from __future__ import annotations

import random
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import quote

import httpx
import msgspec
import pytest

from kvindex.clients.proxy.receipt import Receipt, decode_receipt, unpacked_ids
from tests.integration.test_proxy_forwarding import MODEL, Proxy, _start, stack
from tests.support.processes import KVINDEX

__all__ = ["stack"]
pytestmark = pytest.mark.timeout(180)
NUM_HELD = 40


def _config(tmp_path: Path, **proxy: int) -> tuple[str, ...]:
    config = tmp_path / "kvindex.toml"
    config.write_text("[proxy]\n" + "".join(f"{k} = {v}\n" for k, v in proxy.items()))
    return ("--config", str(config))


def _prompt(rng: random.Random, prefix: int) -> str:
    shared = " ".join(f"p{prefix}w{i}" for i in range(40))
    return f"{shared} " + " ".join(f"u{rng.randrange(10**9)}" for _ in range(8))


def _send(http: httpx.Client, request_id: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    answer = http.post("/v1/completions", json=body, headers={"x-request-id": request_id})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == request_id
    return answer


def _until_indexed(http: httpx.Client, num_blocks: int, timeout_s: float = 10.0) -> None:
    """Wait until the proxy's index holds at least ``num_blocks`` blocks (its ``/stats``)."""
    deadline = time.monotonic() + timeout_s
    while sum(http.get("/stats").json()["blocks"].values()) < num_blocks:
        assert time.monotonic() < deadline, f"fewer than {num_blocks} blocks after {timeout_s} s"
        time.sleep(0.02)


def _receipt(proxy: Proxy, request_id: str) -> Receipt:
    url = f"{proxy.base_url}/decisions/{quote(request_id, safe='')}"
    answer = httpx.get(url, trust_env=False)
    assert answer.status_code == 200, answer.text
    return decode_receipt(answer.content)


def _why(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(KVINDEX), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.fixture
def fleet(stack: ExitStack, tmp_path: Path) -> Proxy:
    """Three sims behind a proxy keeping ``NUM_HELD`` receipts, with their token ids."""
    config = _config(tmp_path, journal_entries=NUM_HELD, journal_token_bytes=4096)
    _, proxy = _start(stack, tmp_path, {"r1": [], "r2": [], "r3": []}, config)
    return proxy


def test_why_explains_a_request_sent_through_the_proxy(fleet: Proxy) -> None:
    rng = random.Random(1)
    with httpx.Client(base_url=fleet.base_url, trust_env=False, timeout=30) as http:
        _send(http, "warm-1", _prompt(rng, 1))
        _until_indexed(http, 2)  # its events are in (else the next may go out before them)
        answer = _send(http, "second-1", _prompt(rng, 1))  # the shared start is cached
    usage = answer.json()["usage"]
    receipt = _receipt(fleet, "second-1")
    print(msgspec.json.encode(receipt).decode())
    assert receipt.model == MODEL and receipt.status == 200
    assert receipt.num_tokens == usage["prompt_tokens"] and receipt.policy == "kv_aware"
    assert {c.replica for c in receipt.candidates} == {"r1", "r2", "r3"}
    assert receipt.chosen == receipt.answered_by == answer.headers["x-kvindex-replica"]
    best = receipt.candidates[0]
    assert best.replica == receipt.chosen and best.matched_tokens >= 32
    assert {"cache", "load"} <= set(best.terms) and receipt.weights["cache"] == 1.0
    assert receipt.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
    assert receipt.outcome == "exact" and receipt.predicted_tokens == best.matched_tokens
    assert receipt.ttfb_ms is not None and receipt.fallbacks
    assert receipt.token_ids is not None
    assert len(unpacked_ids(receipt.token_ids)) == receipt.num_tokens
    shown = _why("why", "second-1", "--proxy", fleet.base_url)
    print(shown.stdout)
    assert shown.returncode == 0, shown.stderr
    for words in ("request second-1", "policy kv_aware", f"chose {receipt.chosen}", "r1", "r2"):
        assert words in shown.stdout
    assert "cache" in shown.stdout and "score" in shown.stdout
    assert "outcome: exact: the index was right" in shown.stdout
    unknown = _why("why", "never-sent", "--proxy", fleet.base_url)
    assert unknown.returncode == 1 and "404" in unknown.stderr and "never-sent" in unknown.stderr


def test_the_memory_journal_holds_its_bound(fleet: Proxy) -> None:
    rng = random.Random(2)
    num_sent = NUM_HELD * 2 + 5
    with httpx.Client(base_url=fleet.base_url, trust_env=False, timeout=30) as http:
        for number in range(num_sent):
            _send(http, f"bound-{number}", _prompt(rng, number % 3))
        kept = http.get("/decisions", params={"limit": 1000})
    assert kept.status_code == 200
    ids = [r.id for r in msgspec.json.decode(kept.content, type=list[Receipt])]
    assert ids == [f"bound-{n}" for n in range(num_sent - NUM_HELD, num_sent)]
    assert _receipt(fleet, f"bound-{num_sent - 1}").status == 200
    gone = httpx.get(f"{fleet.base_url}/decisions/bound-0", trust_env=False)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/decisions/%00", 400),
        ("/decisions/a%0Ab", 400),
        ("/decisions/" + "x" * 5000, 400),
        ("/decisions/%FF%FE", 404),
        ("/decisions/..%2F..%2Fetc", 404),
        ("/decisions?limit=0", 400),
        ("/decisions?limit=-1", 400),
        ("/decisions?limit=abc", 400),
        ("/decisions?limit=1e9", 400),
        ("/decisions?limit=1&limit=2", 400),
        ("/decisions?limit=%D9%A3", 400),  # an Arabic-Indic three: a digit, not ASCII
        ("/decisions?limit=99999999999999999999", 400),
    ],
)
def test_hostile_ids_and_limits_are_refused_with_4xx(
    stack: ExitStack, tmp_path: Path, path: str, status: int
) -> None:
    _, proxy = _start(stack, tmp_path, {"r1": []})
    answer = httpx.get(proxy.base_url + path, trust_env=False)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == status


def test_an_export_replays_through_simulate(fleet: Proxy, tmp_path: Path) -> None:
    rng = random.Random(4)
    with httpx.Client(base_url=fleet.base_url, trust_env=False, timeout=30) as http:
        for number in range(30):
            _send(http, f"replay-{number}", _prompt(rng, number % 4))
    export = tmp_path / "journal.jsonl"
    written = _why("why", "--export", str(export), "--limit", "30", "--proxy", fleet.base_url)
    assert written.returncode == 0, written.stderr
    assert len(export.read_text().splitlines()) == 30
    out = tmp_path / "sim.json"
    run = _why(
        "simulate", "--requests", str(export), "--replicas", "3", "--policies",
        "kv_aware,round_robin", "--json", str(out),
    )  # fmt: skip
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stderr
    report = msgspec.json.decode(out.read_bytes())
    assert report["params"]["source"] == "journal.jsonl" and report["params"]["requests"] == 30
    kv_aware = next(p for p in report["policies"] if p["policy"] == "kv_aware")
    assert kv_aware["requests"] == 30 and kv_aware["hit_rate"] > 0.3
