"""kvindex.api.tokenize: local tokenizer + chat templates, the replica client, the cache, the spec.

The local tokenizer is a tiny WordLevel model trained here on a few sentences, with a BOS
added by a TemplateProcessing post-processor, laid out in ``tmp_path`` like a Hugging
Face model directory. The replica client talks to an ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors, trainers

from kvindex.api.tokenize import (
    CachingTokenizer,
    ChatTemplate,
    LocalTokenizer,
    ReplicaTokenizer,
    TokenizerError,
    TokenizerSpec,
    build_tokenizer,
    load_chat_template,
    messages_key,
)

T = TypeVar("T")
BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SYSTEM = "you are a terse helpful assistant"
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris"},
    {"role": "user", "content": "and what about germany then"},
]
CORPUS = [m["content"] for m in CONVERSATION] + ["the quick brown fox jumps over the lazy dog"]
# HF style: the template adds BOS itself, each turn ends with EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{ raise_exception('unknown role ' + message['role']) }}\n"
    "{% endif %}\n"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# --- a tiny model directory -------------------------------------------------------------


def make_tokenizer() -> tokenizers.Tokenizer:
    """WordLevel over CORPUS; BOS/EOS/role markers special; BOS prepended by the post-processor."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", BOS, EOS, *ROLE_TOKENS]
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    tok.add_special_tokens(specials)
    bos_id = tok.token_to_id(BOS)
    assert bos_id is not None
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


@pytest.fixture
def raw() -> tokenizers.Tokenizer:
    return make_tokenizer()


@pytest.fixture
def model_dir(tmp_path: Path, raw: tokenizers.Tokenizer) -> Path:
    """tokenizer.json + tokenizer_config.json (template, BOS as an AddedToken dict)."""
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": {"content": BOS}, "eos_token": EOS}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def token_id(raw: tokenizers.Tokenizer, token: str) -> int:
    found = raw.token_to_id(token)
    assert found is not None
    return found


def words(raw: tokenizers.Tokenizer, text: str) -> list[int]:
    return raw.encode(text, add_special_tokens=False).ids


def contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    return any(list(haystack[i : i + n]) == list(needle) for i in range(len(haystack) - n + 1))


# --- LocalTokenizer ---------------------------------------------------------------------


def test_prompt_gets_one_bos(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_prompt("the quick brown fox"))
    bos = token_id(raw, BOS)
    assert ids == [bos, *words(raw, "the quick brown fox")]
    assert ids.count(bos) == 1


def test_messages_render_the_whole_conversation(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_messages(CONVERSATION))
    assert contains(ids, words(raw, SYSTEM))  # the first message
    assert contains(ids, words(raw, CONVERSATION[-1]["content"]))  # and the last one
    assert contains(ids, words(raw, CONVERSATION[2]["content"]))
    assert ids.count(token_id(raw, "<|user|>")) == 2
    assert ids[-1] == token_id(raw, "<|assistant|>")  # the generation prompt


def test_messages_bos_is_not_doubled(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_messages(CONVERSATION))
    bos = token_id(raw, BOS)
    assert ids[0] == bos
    assert ids.count(bos) == 1


def test_messages_equal_hf_rendering_encoded_without_specials(
    model_dir: Path, raw: tokenizers.Tokenizer
) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    expected_text = (
        f"{BOS}<|system|> {SYSTEM} {EOS}\n"
        "<|user|> what is the capital of france </s>\n"
        "<|assistant|> paris </s>\n"
        "<|user|> and what about germany then </s>\n"
        "<|assistant|>"
    )
    assert tok.chat_template is not None
    assert tok.chat_template.render(CONVERSATION) == expected_text
    assert asyncio.run(tok.encode_messages(CONVERSATION)) == words(raw, expected_text)


def test_without_template_messages_fail_prompts_work(tmp_path: Path) -> None:
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = LocalTokenizer.from_files(tmp_path / "tokenizer.json")
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        asyncio.run(tok.encode_messages(CONVERSATION))
    assert len(asyncio.run(tok.encode_prompt("paris"))) == 2


@pytest.mark.parametrize("content", ["{ not json", "", "\x00\x01garbage"])
def test_broken_tokenizer_file(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=r"tokenizer file .*tokenizer\.json"):
        LocalTokenizer.from_files(tmp_path / "tokenizer.json")


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="unreadable"):
        LocalTokenizer.from_files(tmp_path / "nope.json")


def test_template_raise_exception_is_a_tokenizer_error(model_dir: Path) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    with pytest.raises(TokenizerError, match="unknown role robot"):
        asyncio.run(tok.encode_messages([{"role": "robot", "content": "hi"}]))


def test_template_failing_on_input_is_a_tokenizer_error(model_dir: Path) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    with pytest.raises(TokenizerError, match="chat template"):
        asyncio.run(tok.encode_messages([{"content": "no role"}]))


def test_long_text_off_loop_equals_inline(model_dir: Path) -> None:
    text = " ".join(CORPUS * 200)
    inline = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    inline.inline_max_chars = len(text)
    threaded = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    threaded.inline_max_chars = 0
    assert asyncio.run(threaded.encode_prompt(text)) == asyncio.run(inline.encode_prompt(text))
    assert asyncio.run(threaded.encode_messages(CONVERSATION)) == asyncio.run(
        inline.encode_messages(CONVERSATION)
    )


# --- chat templates ---------------------------------------------------------------------


def test_environment_matches_transformers() -> None:
    """trim_blocks/lstrip_blocks, HF's tojson (no HTML escaping), loop controls, generation."""
    source = (
        "{% for m in messages %}\n"
        "  {% generation %}{{ m['role'] }}={{ m['content'] | tojson }}{% endgeneration %}\n"
        "  {% if loop.index == 2 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y') | length }}"
    )
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "héllo <b>"},
        {"role": "a", "content": 1},
        {},
    ]
    assert ChatTemplate(source).render(messages) == 'user="héllo <b>"a=14'


def test_template_syntax_error_fails_at_load() -> None:
    with pytest.raises(TokenizerError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_blocks_unsafe_access() -> None:
    for source in ["{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"]:
        with pytest.raises(TokenizerError, match=r"rejected.*unsafe"):
            ChatTemplate(source).render([])


def test_named_templates_use_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    template = load_chat_template(tmp_path / "tokenizer.json")
    assert template is not None
    assert template.render([]) == "D"


def test_sibling_jinja_file_wins_over_config(tmp_path: Path) -> None:
    config = {"chat_template": "config", "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("jinja {{ bos_token }}")
    template = load_chat_template(tmp_path / "tokenizer.json")
    assert template is not None
    assert template.render([]) == "jinja <s>"


def test_explicit_chat_template_path(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "mine.jinja").write_text("mine {{ eos_token }}")
    (tmp_path / "other.json").write_text(json.dumps({"chat_template": "other {{ eos_token }}"}))
    mine = load_chat_template(tmp_path / "tokenizer.json", tmp_path / "mine.jinja")
    other = load_chat_template(tmp_path / "tokenizer.json", tmp_path / "other.json")
    assert mine is not None and other is not None
    assert mine.render([]) == "mine </s>"
    assert other.render([]) == "other "  # special tokens come from the given config


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("tokenizer_config.json", "{ broken", "invalid JSON"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
        ("tokenizer_config.json", '{"chat_template": 3}', "must be a string or a list"),
        ("chat_template.jinja", "{% if %}", "syntax error"),
    ],
)
def test_bad_template_files(tmp_path: Path, name: str, content: str, match: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(TokenizerError, match=match):
        load_chat_template(tmp_path / "tokenizer.json")


def test_explicit_template_path_must_exist_and_have_a_template(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no such file"):
        load_chat_template(tmp_path / "tokenizer.json", tmp_path / "missing.jinja")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has no chat_template"):
        load_chat_template(tmp_path / "tokenizer.json", tmp_path / "empty.json")


# --- ReplicaTokenizer -------------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


def replica_call(handler: Handler, call: Callable[[ReplicaTokenizer], Awaitable[T]]) -> T:
    """Run ``call`` against a ReplicaTokenizer whose client is served by ``handler``."""

    async def main() -> T:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            return await call(ReplicaTokenizer(client, "http://replica:8000/", "m1", timeout_s=2))

    return asyncio.run(main())


def ok(tokens: list[int]) -> Handler:
    body = {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}
    return lambda _: httpx.Response(200, json=body)


def test_replica_prompt_request_shape() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return ok([1, 2, 3])(request)

    assert replica_call(handler, lambda t: t.encode_prompt("hello world")) == [1, 2, 3]
    (request,) = seen
    assert request.method == "POST"
    assert str(request.url) == "http://replica:8000/tokenize"
    assert request.headers["content-type"] == "application/json"
    body = json.loads(request.content)
    assert body == {"model": "m1", "prompt": "hello world", "add_special_tokens": True}


def test_replica_messages_request_shape() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return ok([7])(request)

    assert replica_call(handler, lambda t: t.encode_messages(CONVERSATION)) == [7]
    assert seen == [
        {
            "model": "m1",
            "messages": CONVERSATION,  # the whole conversation, in order
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
    ]


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, '{"object":"error","message":"The model `m1` does not exist.","code":404}'),
        (500, "Internal Server Error"),
        (400, "x" * 5000),
    ],
)
def test_replica_http_errors(status: int, body: str) -> None:
    with pytest.raises(TokenizerError) as info:
        replica_call(lambda _: httpx.Response(status, text=body), lambda t: t.encode_prompt("a"))
    message = str(info.value)
    assert f"HTTP {status}" in message
    assert "http://replica:8000/tokenize" in message
    assert body[:50] in message
    assert len(message) < 400  # an excerpt, not the whole body


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>oops</html>", "malformed"),
        (b"", "malformed"),
        (b'{"count": 2}', "malformed"),
        (b'{"tokens": "1 2"}', "malformed"),
        (b'{"tokens": [1, "2"]}', "malformed"),
        (b'{"tokens": [1, 2.5]}', "malformed"),
        (b'{"tokens": [true]}', "malformed"),
        (b'{"tokens": [-1]}', "malformed"),
        (b'{"tokens": [4294967296]}', "malformed"),
        (b"[1, 2, 3]", "malformed"),
    ],
)
def test_replica_malformed_responses(body: bytes, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        replica_call(lambda _: httpx.Response(200, content=body), lambda t: t.encode_prompt("a"))


def test_replica_empty_token_list_is_valid() -> None:
    assert replica_call(ok([]), lambda t: t.encode_prompt("")) == []


@pytest.mark.parametrize(
    ("exc", "match"),
    [
        (httpx.ConnectError("connection refused"), "unreachable"),
        (httpx.ReadTimeout("slow"), "timed out after 2"),
        (httpx.RemoteProtocolError("peer closed"), "unreachable"),
    ],
)
def test_replica_unreachable(exc: Exception, match: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(TokenizerError, match=match):
        replica_call(handler, lambda t: t.encode_prompt("a"))


def test_replica_messages_not_json() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": object()}]
    with pytest.raises(TokenizerError, match="not JSON-serializable"):
        replica_call(ok([1]), lambda t: t.encode_messages(messages))


# --- CachingTokenizer -------------------------------------------------------------------


class CountingTokenizer:
    """A fake inner tokenizer: one id per character (prompts) or per message."""

    def __init__(self) -> None:
        self.calls: list[object] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = False

    async def encode_prompt(self, prompt: str) -> list[int]:
        self.calls.append(prompt)
        await self._wait()
        return [ord(c) for c in prompt]

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        self.calls.append(messages)
        await self._wait()
        return [len(str(m.get("content"))) for m in messages]

    async def _wait(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise TokenizerError("inner failed")


def test_cache_counts_hits_and_misses() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> None:
        assert await cache.encode_prompt("ab") == [97, 98]
        assert await cache.encode_prompt("ab") == [97, 98]
        assert await cache.encode_prompt("abc") == [97, 98, 99]
        assert await cache.encode_messages(CONVERSATION) == await cache.encode_messages(
            CONVERSATION
        )

    asyncio.run(main())
    assert (cache.num_hits, cache.num_misses) == (2, 3)
    assert len(inner.calls) == 3
    assert len(cache) == 3


def test_cache_returns_copies() -> None:
    cache = CachingTokenizer(CountingTokenizer())

    async def main() -> list[int]:
        first = await cache.encode_prompt("ab")
        first.append(0)
        return await cache.encode_prompt("ab")

    assert asyncio.run(main()) == [97, 98]


def test_cache_evicts_least_recently_used() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner, max_entries=2)

    async def main() -> None:
        for prompt in ["a", "b", "a", "c"]:  # "a" was used after "b": "b" goes
            await cache.encode_prompt(prompt)
        assert len(cache) == 2
        await cache.encode_prompt("a")
        await cache.encode_prompt("c")
        assert cache.num_misses == 3
        await cache.encode_prompt("b")

    asyncio.run(main())
    assert inner.calls == ["a", "b", "c", "b"]
    assert (cache.num_hits, cache.num_misses) == (3, 4)


def test_cache_key_covers_every_message() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    other = [*CONVERSATION[:-1], {"role": "user", "content": "and what about spain then"}]

    async def main() -> None:
        await cache.encode_messages(CONVERSATION)
        await cache.encode_messages(other)  # differs only in the last message: a miss

    asyncio.run(main())
    assert cache.num_misses == 2
    assert messages_key(CONVERSATION) != messages_key(other)
    assert messages_key(CONVERSATION[:1]) != messages_key(CONVERSATION)


def test_cache_key_is_canonical() -> None:
    reordered = [{"content": m["content"], "role": m["role"]} for m in CONVERSATION]
    assert messages_key(reordered) == messages_key(CONVERSATION)


def test_prompt_and_messages_keys_never_collide() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    text = messages_key(CONVERSATION).decode()

    async def main() -> None:
        await cache.encode_messages(CONVERSATION)
        await cache.encode_prompt(text)

    asyncio.run(main())
    assert cache.num_misses == 2


def test_cache_dedupes_concurrent_misses() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[list[int]]:
        inner.gate = asyncio.Event()
        calls = [asyncio.create_task(cache.encode_prompt("xy")) for _ in range(3)]
        await asyncio.sleep(0)
        inner.gate.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(main()) == [[120, 121]] * 3
    assert inner.calls == ["xy"]
    assert (cache.num_hits, cache.num_misses) == (2, 1)


def test_cache_survives_cancelled_first_caller() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[int]:
        inner.gate = asyncio.Event()
        first = asyncio.create_task(cache.encode_prompt("xy"))
        second = asyncio.create_task(cache.encode_prompt("xy"))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        inner.gate.set()
        return await second

    assert asyncio.run(main()) == [120, 121]
    assert inner.calls == ["xy"]


def test_cache_does_not_keep_errors() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[int]:
        inner.fail_next = True
        with pytest.raises(TokenizerError, match="inner failed"):
            await cache.encode_prompt("a")
        return await cache.encode_prompt("a")

    assert asyncio.run(main()) == [97]
    assert len(inner.calls) == 2


def test_cache_rejects_ids_outside_u32() -> None:
    class Negative(CountingTokenizer):
        async def encode_prompt(self, prompt: str) -> list[int]:
            return [-1]

    with pytest.raises(TokenizerError, match=r"\[0, 2\*\*32\)"):
        asyncio.run(CachingTokenizer(Negative()).encode_prompt("a"))


def test_cache_needs_room() -> None:
    with pytest.raises(TokenizerError, match="max_entries"):
        CachingTokenizer(CountingTokenizer(), max_entries=0)


# --- TokenizerSpec and build_tokenizer ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kind": "remote"}, "kind"),
        ({"kind": "local"}, "path"),
        ({"kind": "local", "path": ""}, "path"),
        ({"kind": "local", "path": "t.json", "base_url": "http://h"}, "base_url"),
        ({"kind": "local", "path": "t.json", "model": "m"}, "model"),
        ({"kind": "local", "path": "t.json", "cache_entries": -1}, "cache_entries"),
        ({"kind": "replica", "model": "m"}, "base_url"),
        ({"kind": "replica", "base_url": "tcp://h:1", "model": "m"}, "base_url"),
        ({"kind": "replica", "base_url": "http://h"}, "model"),
        ({"kind": "replica", "base_url": "http://h", "model": "m", "timeout_s": 0}, "timeout_s"),
        ({"kind": "replica", "base_url": "http://h", "model": "m", "path": "t"}, "path"),
        (
            {"kind": "replica", "base_url": "http://h", "model": "m", "chat_template_path": "t"},
            "chat_template_path",
        ),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(TokenizerError, match=rf"^{field}\b"):
        TokenizerSpec(**fields)


def test_build_local_is_cached(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    spec = TokenizerSpec(kind="local", path=str(model_dir / "tokenizer.json"), cache_entries=8)

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, CachingTokenizer)
            assert isinstance(tok.inner, LocalTokenizer)
            assert tok.max_entries == 8
            assert await tok.encode_messages(CONVERSATION) == await tok.encode_messages(
                CONVERSATION
            )
            assert tok.num_hits == 1

    asyncio.run(main())


def test_build_local_with_template_path(tmp_path: Path) -> None:
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jinja").write_text("<|user|>")
    spec = TokenizerSpec(
        kind="local",
        path=str(tmp_path / "tokenizer.json"),
        chat_template_path=str(tmp_path / "t.jinja"),
        cache_entries=0,
    )

    async def main() -> list[int]:
        async with httpx.AsyncClient() as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, LocalTokenizer)
            return await tok.encode_messages([])

    assert len(asyncio.run(main())) == 1


def test_build_local_with_bad_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = TokenizerSpec(kind="local", path=str(tmp_path / "tokenizer.json"))

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            build_tokenizer(spec, client)

    with pytest.raises(TokenizerError, match="tokenizer file"):
        asyncio.run(main())


def test_build_replica_uses_the_given_client() -> None:
    spec = TokenizerSpec(kind="replica", base_url="http://r:8000", model="m1", timeout_s=1.5)

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(ok([4, 5]))) as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, CachingTokenizer)
            inner = tok.inner
            assert isinstance(inner, ReplicaTokenizer)
            assert (inner.client, inner.url, inner.model, inner.timeout_s) == (
                client,
                "http://r:8000/tokenize",
                "m1",
                1.5,
            )
            return await tok.encode_prompt("x")

    assert asyncio.run(main()) == [4, 5]
