"""``kvindex proxy`` forwarding as a user meets it, with the real ``openai`` package: retries
of a refused request elsewhere, the stream idle timeout, bearer tokens in and keys out, the
``[proxy]`` table, LoRA names, pass-through routes, the tokenizer's failover. Every part is
a real process on free loopback ports: ``kvindex replica-sim``s (some told to fail, stall
or ask a key) and the proxy (memory store, its own subscriber)."""

from __future__ import annotations

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
LORA = "sql-lora"
pytestmark = pytest.mark.timeout(90)
Messages = list[openai.types.chat.ChatCompletionMessageParam]


@dataclass
class Proxy:
    child: Child
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        """The openai client a user points at the proxy; no retries of its own (the
        proxy's are under test)."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=30,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )

    def metrics(self, token: str | None = None) -> str:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        return httpx.get(f"{self.base_url}/metrics", headers=headers, trust_env=False).text


@dataclass
class Sims:
    """Replica-sims by id, started in the order given (the proxy lists them so)."""

    children: dict[str, Child]

    def kill(self, rid: str) -> None:
        self.children[rid].kill()


def _start(
    stack: ExitStack,
    workdir: Path,
    sims: dict[str, list[str]],
    proxy_args: tuple[str, ...] = (),
) -> tuple[Sims, Proxy]:
    """``sims`` (id → extra replica-sim options) and a proxy in front of them."""
    specs, children = [], {}
    for rid, extra in sims.items():
        http_port, events_port = free_port(), free_port()
        events = f"tcp://127.0.0.1:{events_port}"
        args = [
            "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
            "--events", events, "--bind-events", "--replay", "", "--speed", "1000",
            "--seed", "7", *extra,
        ]  # fmt: skip
        log, ready = workdir / f"{rid}.log", http_ok(http_port, "/health")
        child = kvindex_child(f"sim {rid}", args, log, ready)
        stack.callback(child.stop)
        child.spawn()
        children[rid] = child
        specs.append(f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}")
    for child in children.values():
        child.wait_ready(40)
    port = free_port()
    args = ["proxy", "--port", str(port), *proxy_args]
    for spec in specs:
        args += ["--replica", spec]
    proxy = kvindex_child("proxy", args, workdir / "proxy.log", http_ok(port, "/readyz"))
    stack.callback(proxy.stop)
    proxy.start(40)
    return Sims(children), Proxy(proxy, port)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _conversation(topic: str) -> Messages:
    words = " ".join(f"{topic}{i}" for i in range(60))
    return [
        {"role": "system", "content": f"You answer questions about {topic}."},
        {"role": "user", "content": words},
    ]


def _ask(client: openai.OpenAI, messages: Messages, model: str = MODEL) -> tuple[str, int]:
    """(replica that answered, the prompt tokens it had cached) of one chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=2
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return raw.headers["x-kvindex-replica"], cached


def _until_cached(client: openai.OpenAI, messages: Messages, model: str = MODEL) -> str:
    """Ask until an answer comes from a replica that had the prompt cached (the proxy's
    index has heard of an earlier answer's blocks): that replica."""
    for _ in range(40):
        replica, cached = _ask(client, messages, model)
        if cached:
            return replica
        time.sleep(0.1)
    raise AssertionError("no answer ever came from a replica holding the prompt")


def test_a_replica_answering_429_or_500_before_the_first_byte_is_retried_elsewhere(
    stack: ExitStack, tmp_path: Path
) -> None:
    sims = {"busy": ["--fail-status", "429"], "broken": ["--fail-status", "500"], "ok": []}
    _, proxy = _start(stack, tmp_path, sims)
    with proxy.client() as client:
        for i in range(6):
            replica, _ = _ask(client, _conversation(f"topic{i}"))  # an error would raise
            assert replica == "ok"
        stream = client.chat.completions.create(
            model=MODEL, messages=_conversation("streamed"), max_tokens=3, stream=True
        )
        assert len([c for c in stream if c.choices]) == 3
    metrics = proxy.metrics()
    assert 'kvindex_proxy_upstream_errors_total{kind="status_429",replica="busy"}' in metrics
    assert 'kvindex_proxy_upstream_errors_total{kind="status_500",replica="broken"}' in metrics
    assert 'kvindex_proxy_retries_total{route="/v1/chat/completions"}' in metrics
    assert 'status="200"' in metrics and 'status="429"' not in metrics


def test_a_stream_idle_past_the_idle_timeout_ends_and_the_proxy_goes_on(
    stack: ExitStack, tmp_path: Path
) -> None:
    sims = {"hung": ["--stream-stall-s", "60"]}
    _, proxy = _start(stack, tmp_path, sims, ("--stream-idle-timeout-s", "1"))
    received: list[str] = []
    started = time.monotonic()
    with proxy.client() as client:
        with pytest.raises((httpx.HTTPError, openai.APIError)):
            stream = client.completions.create(
                model=MODEL, prompt="alpha beta gamma", max_tokens=5, stream=True
            )
            received.extend(c.choices[0].text for c in stream if c.choices)
        took = time.monotonic() - started
        # the first chunk came, then nothing: cut after about 1 s, not the 60 s stall
        assert received == [received[0]] and took < 30, (received, took)
        done = client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=5)
        assert len(done.choices[0].text.split()) == 5  # a whole answer is not a stream


CONFIG = """
[proxy]
auth_token = "client-token"
max_attempts = 2
stream_idle_timeout_s = 30

[proxy.replica_api_keys]
r1 = "key-1"
r2 = "key-2"

[[models]]
name = "demo-model"
loras = ["sql-lora"]
"""


def test_the_proxy_table_bearer_tokens_replica_keys_lora_names_and_pass_through(
    stack: ExitStack, tmp_path: Path
) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text(CONFIG)
    sims = {rid: ["--api-key", f"key-{rid[1:]}", "--lora", LORA] for rid in ("r1", "r2")}
    _, proxy = _start(stack, tmp_path, sims, ("--config", str(config)))
    url = proxy.base_url
    for token in ("unused", "key-1"):  # none of the proxy's: refused before any replica
        with proxy.client(token) as client, pytest.raises(openai.AuthenticationError) as no:
            client.models.list()
        assert no.value.status_code == 401
        assert no.value.response.json()["error"]["type"] == "unauthorized"
    assert httpx.get(f"{url}/healthz", trust_env=False).status_code == 200
    assert httpx.get(f"{url}/metrics", trust_env=False).status_code == 401
    with proxy.client("client-token") as client:
        models = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        assert models == {MODEL: None, LORA: MODEL}
        _ask(client, _conversation("plain"))  # each replica takes only its own key
        messages = _conversation("queries")
        _, cached = _ask(client, messages, LORA)
        assert cached == 0
        _until_cached(client, messages, LORA)  # the LoRA's blocks, found
        assert all(_ask(client, messages, LORA)[1] > 0 for _ in range(3))  # by a holder
        vectors = client.embeddings.with_raw_response.create(model=MODEL, input=["a b", "c"])
        assert vectors.headers["x-kvindex-replica"] in ("r1", "r2")
        assert [len(e.embedding) for e in vectors.parse().data] == [8, 8]
    headers = {"authorization": "Bearer client-token"}
    other = httpx.get(f"{url}/v1/embeddings?x=1", headers=headers, trust_env=False)
    assert other.status_code == 405 and other.headers["x-kvindex-replica"] in ("r1", "r2")
    assert 'route="/v1/{path}"' in proxy.metrics("client-token")


def test_a_dead_first_replica_leaves_tokenizing_to_another(
    stack: ExitStack, tmp_path: Path
) -> None:
    sims, proxy = _start(stack, tmp_path, {"r1": [], "r2": [], "r3": []})
    sims.kill("r1")  # the replica whose /tokenize the proxy asks first
    with proxy.client() as client:
        for topic in ("kites", "lakes"):
            messages = _conversation(topic)
            _ask(client, messages)
            _until_cached(client, messages)
            # Two replicas may hold the prompt by now (an answer came before the index
            # heard of the first): any holder will do, and it is never the dead one.
            replica, cached = _ask(client, messages)
            assert replica != "r1" and cached > 0
    metrics = proxy.metrics()
    blind = f'kvindex_proxy_tokenize_failures_total{{model="{MODEL}"}} 0.0'
    assert blind in metrics  # never routed blind
    assert "kvindex_proxy_matched_fraction_count" in metrics
