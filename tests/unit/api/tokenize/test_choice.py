"""kvindex.api.tokenize.choice: TokenizerSpec validation and build_tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers

from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.choice import TokenizerSpec, build_tokenizer
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.api.tokenize.replica import ReplicaTokenizer
from tests.unit.api.tokenize.samples import CONVERSATION, make_tokenizer, ok


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
