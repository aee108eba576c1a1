"""``POST /score`` under ill-typed chat options, black box: a real ``kvindex serve`` with a local
tokenizer and its chat template (so a body that got through would be rendered) answers each a
422 naming the field, and the same connection then serves a good request (never a 5xx, never a
reset)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator

import pytest

from tests.support.processes import running
from tests.support.redis_server import free_port
from tests.support.tokenizer_kinds import write_model

pytestmark = pytest.mark.timeout(60)
MODEL = "demo-model"
DEPTH = 10_000
MESSAGES = [{"role": "user", "content": "where should this go"}]


def _chat(**fields: str) -> bytes:
    """A chat body with each field's raw JSON text as written."""
    head = json.dumps({"model": MODEL, "messages": MESSAGES})[:-1]
    return "".join([head, *(f', "{k}": {v}' for k, v in fields.items()), "}"]).encode()


def _deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_object(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


HOSTILE = {
    "tools a string": (_chat(tools='"get_weather"'), "at `$.tools`"),
    "tools numbers": (_chat(tools="[1, 2, 3]"), "at `$.tools[0]`"),
    "kwargs a list": (_chat(chat_template_kwargs="[1]"), "at `$.chat_template_kwargs`"),
    "kwargs a list 10,000 deep": (
        _chat(chat_template_kwargs=_deep_list(DEPTH)),
        "at `$.chat_template_kwargs`",
    ),
    "kwargs an object 10,000 deep": (
        _chat(chat_template_kwargs=_deep_object(DEPTH)),
        "nested too deeply",
    ),
    "kwargs holding a list 10,000 deep": (
        _chat(chat_template_kwargs=f'{{"x": {_deep_list(DEPTH)}}}'),
        "nested too deeply",
    ),
    "documents an object": (_chat(documents='{"title": "a"}'), "at `$.documents`"),
    "add_generation_prompt yes": (
        _chat(add_generation_prompt='"yes"'),
        "at `$.add_generation_prompt`",
    ),
    "continued with the generation prompt": (
        _chat(continue_final_message="true"),
        "continue_final_message and add_generation_prompt cannot both be true",
    ),
}


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A ``kvindex serve`` whose model has a local tokenizer and one replica."""
    directory = tmp_path_factory.mktemp("score-hostile")
    tokenizer = write_model(directory / "model")
    config = directory / "kvindex.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    api_port, events_port = free_port(), free_port()
    replica = f"id=r1,model={MODEL},events=tcp://127.0.0.1:{events_port}"
    args = ["serve", "--config", str(config), "--replica", replica, "--port", str(api_port)]
    with running(directory / "serve.log", *args):
        _until_served(api_port)
        yield api_port


def _until_served(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            if _post(connection, _chat())[0] == 200:
                return
        except OSError:
            pass
        finally:
            connection.close()
        assert time.monotonic() < deadline, "kvindex serve did not answer /score"
        time.sleep(0.1)


def _post(connection: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    connection.request("POST", "/score", body, {"content-type": "application/json"})
    answer = connection.getresponse()
    return answer.status, answer.read()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_ill_typed_chat_options_are_422_naming_the_field_and_the_connection_serves_on(
    port: int, case: str
) -> None:
    body, named = HOSTILE[case]
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        status, raw = _post(connection, body)
        assert status == 422, raw[:300]
        error = json.loads(raw)
        assert error["error"] == "invalid_request" and named in error["detail"], error
        status, raw = _post(connection, _chat())  # the same connection, a good body
        assert status == 200, raw[:300]
        assert json.loads(raw)["best"] == "r1"
    finally:
        connection.close()
