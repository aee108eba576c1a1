"""``kvindex proxy`` as a user runs it: the real ``openai`` package → the proxy (a
subprocess, memory store, its own subscriber) → three ``kvindex replica-sim``s (subprocesses
on free loopback ports, events bound, the proxy connected to each)."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import free_port

MODEL = "demo-model"
pytestmark = pytest.mark.timeout(60)


@dataclass
class Sim:
    id: str
    child: Child
    http_port: int
    events_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def spec(self) -> str:
        events = f"tcp://127.0.0.1:{self.events_port}"
        return f"id={self.id},model={MODEL},url={self.url},events={events}"


@dataclass
class Fleet:
    sims: dict[str, Sim]
    proxy: Child
    proxy_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def client(self) -> openai.OpenAI:
        """The openai client a user points at the proxy; no retries of its own (the
        proxy's are under test)."""
        http = openai.DefaultHttpxClient(trust_env=False)
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=20,
            http_client=http,
        )


def _sim(rid: str, workdir: Path) -> Sim:
    http_port, events_port = free_port(), free_port()
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--speed", "1000", "--seed", "7",
    ]  # fmt: skip
    child = kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
    return Sim(rid, child, http_port, events_port)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with ExitStack() as stack:
        sims = {rid: _sim(rid, tmp_path) for rid in ("r1", "r2", "r3")}
        for sim in sims.values():
            stack.callback(sim.child.stop)
            sim.child.spawn()
        for sim in sims.values():
            sim.child.wait_ready(40)
        port = free_port()
        args = ["proxy", "--port", str(port)]
        for sim in sims.values():
            args += ["--replica", sim.spec]
        proxy = kvindex_child("proxy", args, tmp_path / "proxy.log", http_ok(port, "/readyz"))
        stack.callback(proxy.stop)
        proxy.start(40)
        yield Fleet(sims, proxy, port)


@pytest.fixture
def client(fleet: Fleet) -> Iterator[openai.OpenAI]:
    with fleet.client() as client:
        yield client


def _conversation(topic: str) -> list[dict[str, str]]:
    """A system message and a 60-word user turn: several blocks, all of them the topic's."""
    words = " ".join(f"{topic}{i}" for i in range(60))
    return [
        {"role": "system", "content": f"You answer questions about {topic}."},
        {"role": "user", "content": words},
    ]


def test_models_and_health(fleet: Fleet, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    for path in ("/health", "/healthz", "/readyz"):
        assert httpx.get(fleet.base_url + path, trust_env=False).status_code == 200


def test_request_ids_body_limit_and_errors_in_openai_shape(fleet: Fleet) -> None:
    url = f"{fleet.base_url}/v1/completions"
    with httpx.Client(trust_env=False, timeout=20) as http:
        body = {"model": MODEL, "prompt": "a b c", "max_tokens": 1}
        given = http.post(url, json=body, headers={"x-request-id": "req-7"})
        assert given.status_code == 200 and given.headers["x-request-id"] == "req-7"
        made = http.post(url, json=body).headers["x-request-id"]
        assert len(made) == 32
        big = http.post(url, content=b"x" * (8 * 1024 * 1024 + 1))
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        unknown = http.post(url, json={"model": "nope", "prompt": "a"})
        assert unknown.status_code == 404 and "demo-model" in unknown.json()["error"]["message"]
        metrics = http.get(f"{fleet.base_url}/metrics").text
    route = 'route="/v1/completions"'
    assert f'kvindex_proxy_requests_total{{replica="none",{route},status="413"}} 1.0' in metrics
    assert f"kvindex_proxy_time_to_first_byte_seconds_count{{{route}}} 2.0" in metrics
    assert "kvindex_proxy_matched_fraction_count 2.0" in metrics


def test_chat_and_completions_streaming_and_not(fleet: Fleet, client: openai.OpenAI) -> None:
    messages: Messages = [{"role": "user", "content": "one two three four"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    text = chat.choices[0].message.content
    assert chat.object == "chat.completion" and text is not None and len(text.split()) == 5
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) == 5 and "".join(pieces) == text  # the same words, one chunk each
    done = client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=3)
    assert len(done.choices[0].text.split()) == 3
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="alpha beta gamma",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},  # a usage chunk only when asked, as vLLM
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3


Messages = list[openai.types.chat.ChatCompletionMessageParam]


def _ask(client: openai.OpenAI, messages: Messages) -> tuple[str, int]:
    """(replica that answered, the prompt tokens it had cached) of one chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return raw.headers["x-kvindex-replica"], cached


def _until_cached(client: openai.OpenAI, messages: Messages) -> tuple[str, set[str]]:
    """Ask until an answer comes from a replica that had the prompt cached (the proxy's
    index has heard of the first answer's blocks): that replica, and every one that
    answered meanwhile."""
    answered: set[str] = set()
    for _ in range(40):
        replica, cached = _ask(client, messages)
        answered.add(replica)
        if cached:
            return replica, answered
    raise AssertionError("no answer ever came from a replica holding the prompt")


def test_repeated_prompts_land_on_the_replica_that_holds_them(client: openai.OpenAI) -> None:
    num_prompt_tokens = 2 + 60 + 7 + 1  # two role markers, the words, the system's, the cue
    for topic in ("apples", "boats", "clouds", "dunes"):
        messages: Messages = _conversation(topic)  # type: ignore[assignment]
        first, cached = _ask(client, messages)
        assert cached == 0
        time.sleep(0.5)  # time for its blocks' events to reach the proxy's index
        holders = {first} | _until_cached(client, messages)[1]
        # An answer sent before the index heard of the first one's blocks went by load, so
        # a second replica may hold the prompt (a third means routing ignored the cache);
        # each repeat must go to one that holds it.
        assert len(holders) <= 2, holders
        repeats = [_ask(client, messages) for _ in range(4)]
        assert all(c >= num_prompt_tokens // 16 * 16 for _, c in repeats), repeats


def test_a_replica_killed_before_a_request_costs_no_request(
    fleet: Fleet, client: openai.OpenAI
) -> None:
    messages: Messages = _conversation("harbours")  # type: ignore[assignment]
    _ask(client, messages)
    holder, _ = _until_cached(client, messages)
    fleet.sims[holder].child.kill()
    for _ in range(5):
        replica, _cached = _ask(client, messages)  # an error answer would raise
        assert replica != holder
    metrics = httpx.get(f"{fleet.base_url}/metrics", trust_env=False).text
    # Found dead by the request sent to it (a connect error, the request retried); or, when a
    # health check came between the kill and the request, by that check (ejected); or, when
    # its events socket's close was seen first, by the index (its stream stale, its cache
    # discounted, another replica ranked first).
    tried = f'kvindex_proxy_upstream_errors_total{{kind="connect",replica="{holder}"}}' in metrics
    ejected = re.search(
        rf'kvindex_proxy_ejections_total{{reason="\w+",replica="{holder}"}}', metrics
    )
    closed = re.search(rf'kvindex_stream_connected{{[^}}]*replica="{holder}"[^}}]*}} 0\.0', metrics)
    seen = [line for line in metrics.splitlines() if holder in line and line[0] != "#"]
    assert tried or ejected or closed, seen
    if tried:
        assert 'kvindex_proxy_retries_total{route="/v1/chat/completions"}' in metrics


def test_sigterm_drains_the_requests_being_answered_and_accepts_no_new_one(
    tmp_path: Path,
) -> None:
    http_port, events_port = free_port(), free_port()
    sim_args = [
        "replica-sim", "--id", "slow", "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--decode-tps", "50",
    ]  # fmt: skip
    sim = kvindex_child("sim", sim_args, tmp_path / "sim.log", http_ok(http_port, "/health"))
    port = free_port()
    spec = Sim("slow", sim, http_port, events_port).spec
    proxy_args = ["proxy", "--port", str(port), "--replica", spec, "--drain-timeout-s", "20"]
    proxy = kvindex_child("proxy", proxy_args, tmp_path / "proxy.log", http_ok(port, "/readyz"))
    answers: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 100, "stream": True}  # 2 s
    url = f"http://127.0.0.1:{port}/v1/completions"

    def ask() -> None:
        with httpx.Client(trust_env=False, timeout=20) as http:
            answers.append(http.post(url, json=body))

    with ExitStack() as stack:
        for child in (sim, proxy):
            stack.callback(child.stop)
            child.start(40)
        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)  # the request is being answered
        proxy.signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", trust_env=False, timeout=5)
        asker.join(20)
        # drained, then the read path stopped: the process returns (not killed by the signal)
        assert proxy.process is not None and proxy.process.wait(20) == 0
    assert len(answers) == 1 and answers[0].status_code == 200
    assert answers[0].content.endswith(b"data: [DONE]\n\n")
    assert answers[0].content.count(b'"text"') == 100
