"""An API process (``runtime.open_stores``, as ``kvindex api`` builds it) refuses at start an
index it would not read (an older version, another group count), and the CLI says so in
one line; a Redis it cannot reach at start is not an error (the lookup checks later)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.runtime import open_stores
from kvindex.clients.cli import main as cli_main
from kvindex.clients.cli.main import main
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import IndexUnavailableError, OpKind
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema, SchemaVersionError
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis_server

S = StreamId("r1")


def _settings(url: str, groups: int = 0) -> IndexerSettings:
    return IndexerSettings(store="redis", redis_url=url, redis_index_groups=groups)


def _open_api(url: str, groups: int = 0) -> None:
    """Build an API process's stores and close them again."""
    deps = open_stores(ReadPathSettings(_settings(url, groups), ApiSettings(scrape_interval_s=0.0)))
    deps.index.close()


def _indexer_started(url: str, groups: int) -> RedisIndex:
    """An indexer's index as it starts (its first ``intact``), one batch written."""
    index = RedisIndex(connect(url), _settings(url, groups).redis_schema)
    assert index.intact()
    index.apply(S, 0, 1.0, [(OpKind.STORE, Tier.GPU, 1, 101)])
    return index


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_api_on_an_older_index_refuses_to_start_naming_the_fix(
    redis_server: RedisServer, redis_client: redis.Redis, version: str
) -> None:
    redis_client.sadd(f"kvindex:{version}:streams", "r1/0")
    with pytest.raises(SchemaVersionError, match="older schema") as refused:
        _open_api(redis_server.url)
    assert f"'kvindex:{version}:streams' 'kvindex:{version}:index'" in str(refused.value)


def test_an_api_with_another_group_count_than_the_indexer_refuses_to_start(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    _indexer_started(redis_server.url, 16).close()
    with pytest.raises(SchemaVersionError, match=r"written with 16 stream groups.*uses 1:"):
        _open_api(redis_server.url)  # by topology: 1 on this standalone Redis
    _open_api(redis_server.url, 16)  # the indexer's count, set on the API too


def test_an_api_with_the_indexers_count_starts_and_answers(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    _indexer_started(redis_server.url, 0).close()
    settings = _settings(redis_server.url)
    deps = open_stores(ReadPathSettings(settings, ApiSettings(scrape_interval_s=0.0)))
    try:
        assert deps.index.longest_prefix([101], [S])[S].num_blocks == 1
    finally:
        deps.index.close()


def test_the_cli_says_why_in_one_line(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_client.sadd("kvindex:v2:streams", "r1/0")
    monkeypatch.setattr(cli_main, "check_port", lambda host, port: None)  # the schema's turn
    with socket.socket() as taken:  # a port in use: were it not refused, it would not serve
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(main, ["api", "--redis-url", redis_server.url, "--port", port])
    assert result.exit_code == 1, result.output
    assert "Error: redis holds kvindex index data of an older schema" in result.output


@pytest.fixture
def unreachable_url() -> Iterator[str]:
    """A loopback port nothing listens on (bound, never listened: connections refused)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"redis://127.0.0.1:{held.getsockname()[1]}/0"


def test_a_redis_down_at_start_is_checked_at_the_first_lookup(unreachable_url: str) -> None:
    settings = _settings(unreachable_url)
    deps = open_stores(ReadPathSettings(settings, ApiSettings(scrape_interval_s=0.0)))
    try:
        with pytest.raises(IndexUnavailableError):
            deps.index.longest_prefix([101], [S])
    finally:
        deps.index.close()


def test_a_schema_not_checked_at_start_is_checked_by_the_first_lookup(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    index = RedisIndex(redis_client, Schema("kvindex", 1))  # built while Redis was down
    _indexer_started(redis_server.url, 16).close()
    with pytest.raises(SchemaVersionError, match="written with 16 stream groups"):
        index.longest_prefix([101], [StreamId("elsewhere")])
