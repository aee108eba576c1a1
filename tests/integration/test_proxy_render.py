"""``kvindex proxy`` tokenizing by its replicas' render routes: two ``kvindex replica-sim``s
started with ``--enable-scale-out`` (vLLM's flag: the render routes served) or without it
(404 there), the proxy (a subprocess, memory store) in front. Either way a repeated prompt
lands on the replica that holds it; a tokenizer that fails (render forced on replicas that do
not serve it) routes on load alone, and says so: the answer's ``x-kvindex-tokenizer``
header, the failure counter, a warning naming the model and the replicas."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import free_port

MODEL = "demo-model"
TOKENIZER_HEADER = "x-kvindex-tokenizer"
pytestmark = pytest.mark.timeout(90)


@dataclass
class Fleet:
    proxy: Child
    proxy_port: int
    sim_urls: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"


def _sim(rid: str, workdir: Path, scale_out: bool) -> tuple[Child, str]:
    http_port, events_port = free_port(), free_port()
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--speed", "1000", "--seed", "7",
    ]  # fmt: skip
    if scale_out:
        args.append("--enable-scale-out")
    child = kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
    url = f"http://127.0.0.1:{http_port}"
    return child, f"id={rid},model={MODEL},url={url},events=tcp://127.0.0.1:{events_port}"


def _fleet(stack: ExitStack, workdir: Path, *, scale_out: bool, tokenizer: str) -> Fleet:
    sims = [_sim(rid, workdir, scale_out) for rid in ("r1", "r2")]
    for child, _ in sims:
        stack.callback(child.stop)
        child.spawn()
    for child, _ in sims:
        child.wait_ready(40)
    config = workdir / "kvindex.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    port = free_port()
    args = ["proxy", "--port", str(port), "--config", str(config)]
    for _, spec in sims:
        args += ["--replica", spec]
    proxy = kvindex_child("proxy", args, workdir / "proxy.log", http_ok(port, "/readyz"))
    stack.callback(proxy.stop)
    proxy.start(40)
    urls = [spec.split("url=")[1].split(",")[0] for _, spec in sims]
    return Fleet(proxy, port, urls)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _conversation(topic: str) -> list[dict[str, str]]:
    words = " ".join(f"{topic}{i}" for i in range(60))
    return [{"role": "system", "content": f"About {topic}."}, {"role": "user", "content": words}]


def _ask(http: httpx.Client, fleet: Fleet, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    answer = http.post(f"{fleet.base_url}/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer


def _cached(answer: httpx.Response) -> int:
    usage: dict[str, Any] = answer.json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def _failures(http: httpx.Client, fleet: Fleet) -> float:
    for line in http.get(f"{fleet.base_url}/metrics").text.splitlines():
        if line.startswith(f'kvindex_proxy_tokenize_failures_total{{model="{MODEL}"}}'):
            return float(line.split()[-1])
    raise AssertionError("no tokenize-failure series for the model")


@pytest.mark.parametrize("scale_out", [True, False], ids=["render", "tokenize"])
def test_repeats_land_on_the_holder_with_or_without_render(
    tmp_path: Path, stack: ExitStack, scale_out: bool
) -> None:
    fleet = _fleet(stack, tmp_path, scale_out=scale_out, tokenizer="replica")
    with httpx.Client(trust_env=False, timeout=20) as http:
        render = http.post(f"{fleet.sim_urls[0]}/v1/completions/render", json={"model": MODEL})
        assert render.status_code == (400 if scale_out else 404)  # served (no prompt) or not
        for topic in ("apples", "boats", "clouds"):
            messages = _conversation(topic)
            first = _ask(http, fleet, messages)
            assert TOKENIZER_HEADER not in first.headers
            time.sleep(0.5)  # its blocks' events reach the proxy's index
            holder = first.headers["x-kvindex-replica"]
            for _ in range(3):
                again = _ask(http, fleet, messages)
                assert again.headers["x-kvindex-replica"] == holder
                assert _cached(again) >= 64
        assert _failures(http, fleet) == 0


def test_render_ids_are_the_tokenize_ids(tmp_path: Path, stack: ExitStack) -> None:
    (child, spec) = _sim("r1", tmp_path, scale_out=True)
    stack.callback(child.stop)
    child.start(40)
    url = spec.split("url=")[1].split(",")[0]
    messages = _conversation("dunes")
    with httpx.Client(trust_env=False, timeout=20) as http:
        chat = http.post(
            f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}
        )
        listed = http.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "a b c"})
        tokenized_chat = http.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages})
        tokenized = http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "a b c"})
    assert chat.json()["token_ids"] == tokenized_chat.json()["tokens"]
    assert chat.json()["model"] == MODEL and "sampling_params" in chat.json()
    (one,) = listed.json()
    assert one["token_ids"] == tokenized.json()["tokens"]


def test_a_failing_tokenizer_routes_on_load_and_says_so(tmp_path: Path, stack: ExitStack) -> None:
    fleet = _fleet(stack, tmp_path, scale_out=False, tokenizer="render")
    with httpx.Client(trust_env=False, timeout=20) as http:
        answers = [_ask(http, fleet, _conversation("eels")) for _ in range(3)]
        assert all(a.headers.get(TOKENIZER_HEADER) == "failed" for a in answers)
        assert _failures(http, fleet) == 3
        models = http.get(f"{fleet.base_url}/v1/models")
        assert TOKENIZER_HEADER not in models.headers  # not routed by a prompt: no mark
    fleet.proxy.stop()
    log = fleet.proxy.log.read_text()
    warnings = [line for line in log.splitlines() if "tokenizer of demo-model failed" in line]
    assert len(warnings) == 1, log[-3000:]  # one line for the three: held back for a while
    assert "replica r1" in warnings[0] and "replica r2" in warnings[0]
    assert "HTTP 404" in warnings[0] and "--enable-scale-out" in warnings[0]


def _series(http: httpx.Client, fleet: Fleet, name: str, label: str) -> dict[str, float]:
    """One tokenizer series of the model, by its ``label``'s value."""
    pattern = re.compile(rf'^{name}\{{model="{MODEL}",{label}="([^"]+)"\}} (\S+)$', re.M)
    text = http.get(f"{fleet.base_url}/metrics").text
    return {value: float(count) for value, count in pattern.findall(text)}


@pytest.mark.parametrize("scale_out", [True, False], ids=["render", "tokenize"])
def test_both_replicas_tokenize_in_turn_once_found_to_agree(
    tmp_path: Path, stack: ExitStack, scale_out: bool
) -> None:
    """Unique conversations are tokenized by r1 and r2 in turn, not all by the first to answer
    (the other is vetted by a probe in the background first); repeats still land on their
    holder."""
    fleet = _fleet(stack, tmp_path, scale_out=scale_out, tokenizer="replica")
    with httpx.Client(timeout=30, trust_env=False) as http:
        _ask(http, fleet, _conversation("first"))
        deadline = time.monotonic() + 10
        verdicts: dict[str, float] = {}
        while verdicts.get("agrees") != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            verdicts = _series(http, fleet, "kvindex_tokenizer_replicas", "verdict")
        assert verdicts == {"agrees": 2, "differs": 0, "unvetted": 0}
        for i in range(20):
            _ask(http, fleet, _conversation(f"topic{i}"))
        answers = _series(http, fleet, "kvindex_tokenizer_answers_total", "replica")
        assert sum(answers.values()) == 21
        assert min(answers.get("r1", 0), answers.get("r2", 0)) >= 9, answers
        repeated = _conversation("topic3")
        _ask(http, fleet, repeated)
        assert _cached(_ask(http, fleet, repeated)) > 0
