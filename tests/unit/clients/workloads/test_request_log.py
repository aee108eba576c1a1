"""The request-log reader and its tokenizer: every layout a line may have, and bad lines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from kvindex.clients.workloads.request_log import (
    DEFAULT_MODEL,
    LoggedRequest,
    LogProblem,
    LogTokenizer,
    Problems,
    RequestLogError,
    TokenizerOptions,
    parse_line,
    read_request_log,
    tokenized,
)
from tests.support.request_logs import chat, make_tokenizer, write_log


def read(path: Path) -> tuple[list[LoggedRequest], Problems]:
    problems = Problems()
    return list(read_request_log(path, problems)), problems


def test_chat_and_completions_bodies_are_read_in_order(tmp_path: Path) -> None:
    rows = [
        chat("sys", "hi", max_tokens=7, user="ann"),
        {"model": "m", "prompt": "once upon a time"},
        {"prompt": [1, 2, 3]},
    ]
    requests, problems = read(write_log(tmp_path / "log.jsonl", rows))
    assert problems.count == 0
    assert [r.line for r in requests] == [1, 2, 3]
    assert requests[0].messages == rows[0]["messages"]
    assert (requests[0].max_tokens, requests[0].user) == (7, "ann")
    assert requests[1].prompt == "once upon a time"
    assert requests[2].prompt_ids == [1, 2, 3]
    assert requests[2].model == DEFAULT_MODEL


def test_a_body_wrapper_and_gzip_are_read_alike(tmp_path: Path) -> None:
    rows = [{"timestamp": 12.5, "body": chat("sys", "hi")}, {"body": chat("sys", "yo")}]
    requests, _ = read(write_log(tmp_path / "log.jsonl.gz", rows, gz=True))
    assert [r.messages[1]["content"] for r in requests if r.messages] == ["hi", "yo"]
    assert [r.timestamp_s for r in requests] == [12.5, None]


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path: Path) -> None:
    requests, _ = read(write_log(tmp_path / "log.jsonl", [chat("s", "u")], gz=True))
    assert len(requests) == 1


def test_bad_lines_are_reported_with_their_number_and_skipped(tmp_path: Path) -> None:
    rows: list[object] = [
        chat("s", "ok"),
        "{not json",
        "[1, 2]",
        {"model": "m"},
        {"model": "m", "messages": []},
        {"model": "m", "prompt": 5},
        {"model": 3, "prompt": "x"},
        {"body": "x"},
        {"prompt": "x", "timestamp": "yesterday"},
        {"messages": [{"content": "no role"}]},
        "",
        chat("s", "also ok"),
    ]
    requests, problems = read(write_log(tmp_path / "log.jsonl", rows))
    assert [r.line for r in requests] == [1, 12]
    assert [p.line for p in problems.kept] == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert problems.count == 9
    assert "line 2: not JSON" in str(problems.kept[0])
    assert "neither 'messages' nor 'prompt'" in problems.kept[2].reason
    assert "'timestamp'" in problems.kept[7].reason


def test_problems_are_all_counted_but_a_few_kept() -> None:
    problems = Problems(keep=2)
    for line in range(5):
        problems.add(LogProblem(line, "bad"))
    assert (problems.count, len(problems.kept)) == (5, 2)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (1_700_000_000, 1_700_000_000.0),
        (1_700_000_000_123, 1_700_000_000.123),
        ("2026-12-02T01:00:00Z", 1_796_173_200.0),
        ("2026-12-02T01:00:00+00:00", 1_796_173_200.0),
    ],
)
def test_timestamps_in_seconds_milliseconds_or_iso(value: object, seconds: float) -> None:
    request = parse_line(1, json.dumps({"prompt": "x", "created": value}))
    assert request.timestamp_s == pytest.approx(seconds)


def test_content_parts_become_text() -> None:
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image_url"},
        {"type": "text", "text": "here"},
    ]
    line = json.dumps({"messages": [{"role": "user", "content": parts}]})
    request = parse_line(1, line)
    assert request.messages == [{"role": "user", "content": "look\nhere"}]


def test_a_conversation_is_named_by_its_user_or_its_first_messages() -> None:
    turn1 = parse_line(1, json.dumps(chat("s", "hello")))
    turn2_messages = [*chat("s", "hello")["messages"], {"role": "assistant", "content": "hi"}]
    turn2 = parse_line(2, json.dumps({"messages": turn2_messages}))
    other = parse_line(3, json.dumps(chat("s", "bye")))
    assert turn1.conversation() == turn2.conversation() != other.conversation()
    assert parse_line(4, json.dumps(chat("s", "x", user="u1"))).conversation() == "user:u1"
    assert parse_line(5, json.dumps({"prompt": "p"})).conversation() == "line:5"


def test_a_missing_log_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RequestLogError, match="no such file"):
        list(read_request_log(tmp_path / "none.jsonl", Problems()))


def test_a_truncated_gzip_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    path = write_log(tmp_path / "log.gz", [chat("s", "u")] * 50, gz=True)
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(RequestLogError):
        read(path)


def test_tokenizer_options_need_exactly_one_source(tmp_path: Path) -> None:
    with pytest.raises(RequestLogError, match="exactly one"):
        TokenizerOptions()
    with pytest.raises(RequestLogError, match="exactly one"):
        TokenizerOptions(path=tmp_path, url="http://x")
    with pytest.raises(RequestLogError, match="http"):
        TokenizerOptions(url="ftp://x")
    with pytest.raises(RequestLogError, match="--chat-template"):
        TokenizerOptions(url="http://x", chat_template_path=tmp_path)


def test_an_unreadable_tokenizer_file_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(RequestLogError, match="tokenizer"):
        LogTokenizer(TokenizerOptions(path=bad))


def tokenize_all(options: TokenizerOptions, path: Path) -> tuple[list[list[int]], Problems]:
    async def go() -> tuple[list[list[int]], Problems]:
        problems = Problems()
        async with LogTokenizer(options) as tok:
            out = [
                t.tokens async for t in tokenized(read_request_log(path, problems), tok, problems)
            ]
        return out, problems

    return asyncio.run(go())


def test_messages_without_a_template_use_the_default_rendering(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    log = write_log(tmp_path / "log.jsonl", [chat("rules", "question")])
    (tokens,), _ = tokenize_all(TokenizerOptions(path=tokenizer), log)
    options = TokenizerOptions(path=tokenizer)
    tok = LogTokenizer(options)
    text = asyncio.run(tok.decode("m", tokens))
    assert text == "<|system|>\nrules\n<|user|>\nquestion\n<|assistant|>\n"


def test_a_given_chat_template_is_used(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    log = write_log(tmp_path / "log.jsonl", [chat("a", "b")])
    options = TokenizerOptions(path=tokenizer, chat_template_path=template)
    (tokens,), _ = tokenize_all(options, log)
    assert asyncio.run(LogTokenizer(options).decode("m", tokens)) == "[a][b]"


def test_a_logged_chats_tools_and_template_variables_are_rendered(tmp_path: Path) -> None:
    """A log's chat is tokenized as its engine rendered it: tools and kwargs included."""
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ mood | default('') }}"
    )
    with_tools = {
        **chat("a", "b"),
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"mood": "!"},
    }
    log = write_log(tmp_path / "log.jsonl", [with_tools, chat("a", "b")])
    options = TokenizerOptions(path=tokenizer, chat_template_path=template)
    both, _ = tokenize_all(options, log)
    texts = [asyncio.run(LogTokenizer(options).decode("m", tokens)) for tokens in both]
    assert texts == ["<f>[a][b]!", "[a][b]"]


def test_a_request_the_template_rejects_is_reported_and_skipped(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception('no system') if messages[0]['role'] == 'system' }}x")
    rows = [chat("a", "b"), {"messages": [{"role": "user", "content": "c"}]}]
    log = write_log(tmp_path / "log.jsonl", rows)
    out, problems = tokenize_all(TokenizerOptions(path=tokenizer, chat_template_path=template), log)
    assert len(out) == 1
    assert problems.kept[0].line == 1 and "cannot tokenize" in problems.kept[0].reason


def test_a_replica_tokenizes_per_model_and_detokenizes(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": "decoded"})
        return httpx.Response(200, json={"count": 2, "max_model_len": 9, "tokens": [5, 6]})

    log = write_log(tmp_path / "log.jsonl", [chat("s", "u"), {"model": "b", "prompt": "p"}])
    options = TokenizerOptions(url="http://replica:8000")

    async def go() -> tuple[list[list[int]], str]:
        transport = httpx.MockTransport(handler)
        async with (
            httpx.AsyncClient(transport=transport) as client,
            LogTokenizer(options, client) as tok,
        ):
            problems = Problems()
            tokens = [
                t.tokens async for t in tokenized(read_request_log(log, problems), tok, problems)
            ]
            return tokens, await tok.decode("b", [5, 6])

    tokens, text = asyncio.run(go())
    assert tokens == [[5, 6], [5, 6]]
    assert text == "decoded"
    assert [b["model"] for b in seen] == ["m", "b", "b"]
    assert "messages" in seen[0] and seen[1]["prompt"] == "p"


def test_an_unreachable_replica_is_reported_per_request(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    log = write_log(tmp_path / "log.jsonl", [chat("s", "u")])

    async def go() -> tuple[int, Problems, str]:
        transport = httpx.MockTransport(handler)
        options = TokenizerOptions(url="http://r:1")
        async with (
            httpx.AsyncClient(transport=transport) as client,
            LogTokenizer(options, client) as tok,
        ):
            problems = Problems()
            n = len([t async for t in tokenized(read_request_log(log, problems), tok, problems)])
            return n, problems, await tok.decode("m", [1])

    n, problems, text = asyncio.run(go())
    assert n == 0 and problems.count == 1 and "unreachable" in problems.kept[0].reason
    assert text == "token ids [1]"
