"""``kvindex proxy`` as a front door, black box: no spelling of a path leaves ``/v1/``, only
inference routes reach a replica unless ``proxy.extra_routes`` lists more, and the client's
``Authorization`` never reaches a replica. Real ``kvindex replica-sim``s behind a real proxy;
paths are sent as written (``http.client``: httpx would normalise them first)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.test_proxy_forwarding import MODEL, Proxy, Sims, _start

pytestmark = pytest.mark.timeout(90)
TOKEN = "client-token"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}
ESCAPES = [
    ("/v1/../kvsim/cached", {"prompts": ["a b c"]}),
    ("/v1/./../tokenize", {"prompt": "a b c"}),
    ("/v1/%2e%2e/tokenize", {"prompt": "a b c"}),
    ("/v1/%2E%2E/kvsim/cached", {"prompts": ["a b c"]}),
    ("/v1//..//tokenize", {"prompt": "a b c"}),
    ("/v1\\..\\tokenize", {"prompt": "a b c"}),
]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@dataclass(frozen=True)
class Answer:
    status: int
    replica: str | None
    """Its ``x-kvindex-replica``: the replica that answered through the proxy."""
    body: bytes


def _post(port: int, path: str, body: object, token: str | None = None) -> Answer:
    """``POST path`` exactly as written."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    try:
        connection.request("POST", path, json.dumps(body).encode(), headers)
        answer = connection.getresponse()
        return Answer(answer.status, answer.getheader("x-kvindex-replica"), answer.read())
    finally:
        connection.close()


def _refused(proxy: Proxy, path: str, body: object, token: str | None = None) -> None:
    """The proxy's own OpenAI-shaped 404: no replica answered (none was asked)."""
    answer = _post(proxy.port, path, body, token)
    error = json.loads(answer.body or b"{}").get("error", {})
    assert (answer.status, error.get("type")) == (404, "not_found"), (path, answer.status)
    assert answer.replica is None, path


def _sim_port(sims: Sims, rid: str) -> int:
    args = sims.children[rid].args
    return int(args[args.index("--port") + 1])


def _workdir(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


def test_no_spelling_of_dot_segments_leaves_v1(stack: ExitStack, tmp_path: Path) -> None:
    sims, proxy = _start(stack, tmp_path, {"r1": []})
    sim_port = _sim_port(sims, "r1")
    for route, body in (("/tokenize", ESCAPES[1][1]), ("/kvsim/cached", ESCAPES[0][1])):
        assert _post(sim_port, route, body).status == 200  # what reaching them would do
    for path, body in [*ESCAPES, ("/tokenize", {"prompt": "a"}), ("/kvsim/cached", {})]:
        _refused(proxy, path, body)
    inside = _post(proxy.port, "/v1/./chat//completions", CHAT)  # normalised, still /v1
    assert inside.status == 200 and inside.replica == "r1"
    metrics = proxy.metrics()
    assert 'route="/v1/{path}"' not in metrics  # nothing went through the pass-through


def test_admin_routes_are_404_unless_listed_in_extra_routes(
    stack: ExitStack, tmp_path: Path
) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text('[proxy]\nextra_routes = ["/v1/load_lora_adapter"]\n')
    adapter = {"lora_name": "sql-lora", "lora_path": "/models/sql-lora"}
    _, closed = _start(stack, _workdir(tmp_path, "closed"), {"r1": []})
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models/x"):
        _refused(closed, path, adapter)
    _, listed = _start(stack, tmp_path, {"r2": []}, ("--config", str(config)))
    # The replica-sim has no such route: its own 404, from behind the proxy.
    passed = _post(listed.port, "/v1/load_lora_adapter", adapter)
    assert passed.status == 404 and passed.replica == "r2"
    _refused(listed, "/v1/unload_lora_adapter", adapter)
    embedded = _post(listed.port, "/v1/embeddings", {"model": MODEL, "input": ["a b"]})
    assert embedded.status == 200 and embedded.replica == "r2"


def test_the_clients_token_never_reaches_a_replica(stack: ExitStack, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    # This replica would accept the proxy's own token, were it forwarded.
    _, plain = _start(
        stack,
        _workdir(tmp_path, "a"),
        {"r1": ["--api-key", TOKEN]},
        ("--token-file", str(token_file)),
    )
    answer = _post(plain.port, "/v1/chat/completions", CHAT, TOKEN)
    assert answer.status == 401 and answer.replica == "r1"
    config = tmp_path / "kvindex.toml"
    config.write_text('[proxy]\nupstream_api_key = "vllm-key"\n')
    args = ("--token-file", str(token_file), "--config", str(config))
    _, keyed = _start(stack, _workdir(tmp_path, "b"), {"r2": ["--api-key", "vllm-key"]}, args)
    answer = _post(keyed.port, "/v1/chat/completions", CHAT, TOKEN)
    assert answer.status == 200 and answer.replica == "r2"
    assert _post(keyed.port, "/v1/chat/completions", CHAT).status == 401  # the proxy's token


def test_the_clients_authorization_goes_on_only_when_told(stack: ExitStack, tmp_path: Path) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text("[proxy]\nforward_client_authorization = true\n")
    sims = {"r1": ["--api-key", "vllm-key"]}
    _, proxy = _start(stack, tmp_path, sims, ("--config", str(config)))
    with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as client:
        told = client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer vllm-key"}
        )
        assert told.status_code == 200 and told.headers["x-kvindex-replica"] == "r1"
