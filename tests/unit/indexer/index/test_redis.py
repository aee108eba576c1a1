"""What only the Redis backend has: key layout, prefixes, dropped connections, bad names.

Behaviour shared with the memory backend is proven in ``tests/contract``. Every test here
talks to a private redis-server started by the fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import (
    SKIPPED,
    BlockIndex,
    HolderLookup,
    IndexUnavailableError,
    Op,
    OpKind,
    PrefixMatch,
    StreamStats,
)
from kvindex.indexer.index.redis import RedisIndex, group_matches, holder_tiers
from kvindex.indexer.redis.connection import RedisClient, connect, connect_bounded
from kvindex.indexer.redis.schema import (
    CLUSTER_INDEX_GROUPS,
    DEFAULT_PREFIX,
    META_TIER_PREFIX,
    META_TS,
    META_WATERMARK,
    STANDALONE_INDEX_GROUPS,
    Schema,
    SchemaError,
    SchemaVersionError,
)
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import RedisServer, free_port, running_redis

pytestmark = pytest.mark.redis_server

SCHEMA = Schema("test", CLUSTER_INDEX_GROUPS)
"""Most tests here: several groups on one server (the contract suites run the count
chosen by topology, one group on standalone Redis)."""
S = StreamId("r1", 0)
S_RANK1 = StreamId("r1", 1)
S_OTHER = StreamId("r2", 3)
GPU_ONLY = {Tier.GPU: 1, Tier.CPU: 0, Tier.OTHER: 0}


def store(engine_hash: int, key: int, tier: Tier = Tier.GPU) -> Op:
    return (OpKind.STORE, tier, engine_hash, key)


def be8(value: int) -> bytes:
    return value.to_bytes(8, "big")


def contents(client: redis.Redis) -> dict[bytes, object]:
    """Every key in the server and what it holds (hashes and sets only: all kvindex uses)."""
    found: dict[bytes, object] = {}
    for key in client.scan_iter():
        kind = client.type(key)
        found[key] = client.hgetall(key) if kind == b"hash" else client.smembers(key)
    return found


def stream_keys(stream: StreamId, schema: Schema = SCHEMA) -> set[bytes]:
    """The keys a stream holding blocks has: its own (but ``lost``, which stays empty unless
    an engine hash is stored again with another key) and its group's two hashes."""
    names = schema.stream(stream)
    return {n.encode() for n in (names.meta, names.hashes, names.holders, names.members)}


def own_keys(stream: StreamId, schema: Schema = SCHEMA) -> set[bytes]:
    return {name.encode() for name in schema.stream(stream).own()}


def record(number: int, form: int) -> bytes:
    """A 2-byte holder record (``redis_schema``): held once, on tier ``form``."""
    return (number * 4 + form).to_bytes(2, "big")


@pytest.fixture
def index(redis_client: redis.Redis) -> RedisIndex:
    return RedisIndex(redis_client, SCHEMA)


@pytest.fixture
def own_client(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[RedisClient]:
    """A client configured as in production (``connect``); ``redis_client`` flushed the server."""
    client = connect(redis_server.url)
    yield client
    client.close()


# --- key layout ---------------------------------------------------------------------------


def test_keys_after_a_batch_are_the_schema_names(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    index.apply(S, 0, 1.0, [store(1, 101)])
    index.apply(S_OTHER, 0, 1.0, [store(1, 101)])
    expected = {SCHEMA.streams.encode()} | stream_keys(S) | stream_keys(S_OTHER)
    assert set(redis_client.scan_iter()) == expected
    assert redis_client.smembers(SCHEMA.streams) == {b"r1/0", b"r2/3"}


def test_each_streams_keys_share_one_cluster_slot(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    streams = [S, S_RANK1, S_OTHER, StreamId("pod-7.ns:8000", 12)]
    for stream in streams:
        index.apply(stream, 0, 1.0, [store(1, 101)])
    in_redis = set(redis_client.scan_iter()) - {SCHEMA.streams.encode()}
    assert in_redis == set().union(*(stream_keys(s) for s in streams))
    for stream in streams:
        slots = {key_slot(name.encode()) for name in SCHEMA.stream(stream).all()}
        assert slots == {key_slot(f"ix{SCHEMA.group_of(stream)}".encode())}, stream


def test_streams_are_spread_over_the_groups() -> None:
    groups = [SCHEMA.group_of(StreamId(f"r{i}")) for i in range(1_000)]
    counts = [groups.count(g) for g in range(SCHEMA.index_groups)]
    assert min(counts) > 1_000 / SCHEMA.index_groups / 2, counts


def test_stored_layout(index: RedisIndex, redis_client: redis.Redis) -> None:
    key = 0x0102030405060708
    index.apply(S, 4, 1.5, [store(9, key), store(9, key), store(9, key, Tier.OTHER)])
    names = SCHEMA.stream(S)
    # stream number 0, the long form (3): counts gpu 2, cpu 0, other 1 as u16s
    held = (0 * 4 + 3).to_bytes(2, "big") + bytes([0, 2, 0, 0, 0, 1])
    assert redis_client.hgetall(names.holders) == {be8(key)[2:]: held}
    assert redis_client.hgetall(names.hashes) == {be8(9): be8(key)}
    members = redis_client.hgetall(names.members)
    assert (members[b"r1/0"], members[b"#next"], members[b"#groups"]) == (b"0", b"1", b"16")
    meta = redis_client.hgetall(names.meta)
    assert meta[META_WATERMARK.encode()] == b"4"
    assert float(meta[META_TS.encode()]) == 1.5
    assert meta[f"{META_TIER_PREFIX}{Tier.GPU.value}".encode()] == b"1"
    assert meta[f"{META_TIER_PREFIX}{Tier.OTHER.value}".encode()] == b"1"


def test_default_prefix(redis_client: redis.Redis) -> None:
    index = RedisIndex(redis_client)
    index.apply(S, 0, 1.0, [store(1, 101)])
    assert index.schema == Schema(DEFAULT_PREFIX, STANDALONE_INDEX_GROUPS)  # by topology
    names = {k.decode() for k in redis_client.scan_iter()}
    assert names == {Schema().streams, *(n.decode() for n in stream_keys(S, index.schema))}
    assert all(name.startswith(f"{DEFAULT_PREFIX}:v3:") for name in names)  # the index's own


def test_holders_of_one_block_share_its_field_in_number_order(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    one_group = [s for s in (StreamId(f"g{i}") for i in range(200)) if SCHEMA.group_of(s) == 0]
    a, b, c = one_group[:3]
    index.apply(a, 0, 1.0, [store(1, 101)])
    index.apply(c, 0, 1.0, [store(1, 101, Tier.OTHER)])
    index.apply(b, 0, 1.0, [store(1, 101, Tier.CPU)])
    holders = SCHEMA.group(0)[0]
    assert redis_client.hget(holders, be8(101)[2:]) == record(0, 0) + record(1, 2) + record(2, 1)
    index.apply(c, 1, 1.0, [(OpKind.REMOVE, Tier.OTHER, 1, 0)])
    assert redis_client.hget(holders, be8(101)[2:]) == record(0, 0) + record(2, 1)
    index.drop(a)
    index.drop(b)
    assert redis_client.hget(holders, be8(101)[2:]) is None
    assert redis_client.exists(SCHEMA.group(0)[1]) == 1  # c still has its number
    index.drop(c)
    assert list(redis_client.scan_iter()) == []


def test_two_prefixes_do_not_see_each_other(redis_client: redis.Redis) -> None:
    a = RedisIndex(redis_client, Schema("a"))
    b = RedisIndex(redis_client, Schema("b"))
    a.apply(S, 5, 1.0, [store(1, 101)])
    assert b.streams() == []
    assert b.longest_prefix([101], [S]) == {S: PrefixMatch()}
    assert b.stats(S).watermark == -1
    assert b.apply(S, 0, 2.0, [store(2, 102)]).applied
    b.drop(S)
    assert a.streams() == [S]
    assert a.longest_prefix([101], [S]) == {S: PrefixMatch((Tier.GPU,))}
    assert a.stats(S) == StreamStats(S, 5, 1.0, GPU_ONLY)
    b_left = {k for k in redis_client.scan_iter() if not k.startswith(b"a:")}
    assert b_left == {b"b:v3:groups"}  # b's lookup named its group count, nothing else


# --- clear and drop touch only the stream's own keys --------------------------------------


def commands_run(client: redis.Redis) -> set[str]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_") for name in stats} - {"info", "config|resetstat"}


VISITS = {"evalsha", "hget", "hmget", "hvals", "smembers", "hset", "hdel", "del", "hincrby"}
"""What a clear or drop may run: reads and writes of named keys (never KEYS, SCAN, HSCAN)."""


def held_by_others(index: RedisIndex) -> object:
    return [
        (index.longest_prefix([101, 102], [s]), index.resolve(s, [1, 2]), index.stats(s))
        for s in (S_RANK1, S_OTHER)
    ]


@pytest.mark.parametrize(
    ("action", "listed_after"),
    [
        (RedisIndex.clear, {b"r1/0", b"r1/1", b"r2/3"}),
        (RedisIndex.drop, {b"r1/1", b"r2/3"}),
    ],
    ids=["clear", "drop"],
)
def test_clear_and_drop_touch_only_the_streams_keys(
    index: RedisIndex,
    redis_client: redis.Redis,
    action: Callable[[RedisIndex, StreamId], None],
    listed_after: set[bytes],
) -> None:
    for stream in (S, S_RANK1, S_OTHER):
        index.apply(stream, 0, 1.0, [store(1, 101), store(2, 102, Tier.CPU)])
    others = held_by_others(index)
    redis_client.config_resetstat()
    action(index, S)
    assert commands_run(redis_client) <= VISITS | {"srem"}  # never KEYS or a scan
    assert redis_client.smembers(SCHEMA.streams) == listed_after
    assert not any(redis_client.exists(name) for name in own_keys(S))
    assert index.longest_prefix([101], [S]) == {S: PrefixMatch()}
    assert held_by_others(index) == others


def test_clear_of_unknown_stream_leaves_no_keys(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    index.clear(S)
    assert list(redis_client.scan_iter()) == []
    assert index.stats(S) == StreamStats(S, -1, None, dict.fromkeys(Tier, 0))


# --- registration -------------------------------------------------------------------------


def test_stream_dropped_by_another_indexer_is_listed_again(redis_client: redis.Redis) -> None:
    mine = RedisIndex(redis_client, SCHEMA)
    other = RedisIndex(redis_client, SCHEMA)
    mine.apply(S, 0, 1.0, [store(1, 101)])
    other.drop(S)
    assert mine.apply(S, 1, 1.0, [store(2, 102)]).applied
    assert mine.streams() == [S]
    assert other.streams() == [S]


@pytest.mark.parametrize("replica", ["r{1}", "r{1", "r}1", "r/1", "", "r 1", "r1\n", "répl"])
def test_bad_replica_ids_raise_schema_error(
    index: RedisIndex, redis_client: redis.Redis, replica: str
) -> None:
    with pytest.raises(SchemaError, match="replica id"):
        index.apply(StreamId(replica, 0), 0, 1.0, [store(1, 101)])
    assert list(redis_client.scan_iter()) == []


# --- dropped connections and an unreachable server ----------------------------------------


class _LosesOneReply(redis.Connection):
    """Reads a reply, then fails as if it had been lost on the way (the client disconnects)."""

    armed = False
    num_lost = 0

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().read_response(*args, **kwargs)
        if _LosesOneReply.armed:
            _LosesOneReply.armed = False
            _LosesOneReply.num_lost += 1
            raise redis.ConnectionError("reply lost (injected by the test)")
        return response


def test_retry_after_a_lost_reply_is_idempotent(
    own_client: redis.Redis, redis_client: redis.Redis
) -> None:
    own_client.connection_pool.connection_class = _LosesOneReply
    _LosesOneReply.armed, _LosesOneReply.num_lost = False, 0
    index = RedisIndex(own_client, SCHEMA)
    index.apply(S, 0, 1.0, [])  # registers the stream and loads the script
    _LosesOneReply.armed = True
    # The server applied the batch; connect()'s retry sends it again, which is skipped.
    assert index.apply(S, 1, 2.0, [store(1, 101)]) == SKIPPED
    assert _LosesOneReply.num_lost == 1
    assert redis_client.hget(SCHEMA.stream(S).holders, be8(101)[2:]) == record(0, 0)
    assert index.stats(S) == StreamStats(S, 1, 2.0, GPU_ONLY)


def test_retried_batch_after_client_kill_is_skipped(
    own_client: redis.Redis, redis_client: redis.Redis
) -> None:
    index = RedisIndex(own_client, SCHEMA)
    ops = [store(1, 101), store(2, 102, Tier.CPU)]
    assert index.apply(S, 3, 1.0, ops).applied
    before = contents(redis_client)
    assert redis_client.client_kill_filter(_type="normal") >= 1
    assert index.apply(S, 3, 9.0, ops) == SKIPPED
    assert contents(redis_client) == before


def test_connection_drop_between_batches_is_survived(
    own_client: redis.Redis, redis_client: redis.Redis
) -> None:
    index = RedisIndex(own_client, SCHEMA)
    index.apply(S, 0, 1.0, [store(1, 101)])
    client_id = own_client.client_id()
    assert redis_client.client_kill_filter(_type="normal") >= 1
    assert index.apply(S, 1, 2.0, [store(2, 102)]).applied
    assert own_client.client_id() != client_id
    assert index.longest_prefix([101, 102], [S]) == {S: PrefixMatch((Tier.GPU, Tier.GPU))}


def test_lookup_after_scripts_were_flushed(index: RedisIndex, redis_client: redis.Redis) -> None:
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102)])
    assert index.longest_prefix([101, 102], [S]) == {S: PrefixMatch((Tier.GPU, Tier.GPU))}
    redis_client.script_flush()
    assert index.longest_prefix([101, 102], [S]) == {S: PrefixMatch((Tier.GPU, Tier.GPU))}


def test_restart_that_loses_data_is_survived() -> None:
    with running_redis() as server:
        index = RedisIndex(connect(server.url), SCHEMA)
        try:
            index.apply(S, 5, 1.0, [store(1, 101)])
            server.restart()  # no persistence: data and loaded scripts are gone
            assert index.apply(S, 6, 2.0, [store(2, 102)]).applied
            assert index.streams() == [S]
            assert index.stats(S) == StreamStats(S, 6, 2.0, GPU_ONLY)
        finally:
            index.close()


def _no_retry_client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))


CALLS: dict[str, Callable[[RedisIndex], object]] = {
    "apply": lambda ix: ix.apply(S, 0, 1.0, [store(1, 101)]),
    "resolve": lambda ix: ix.resolve(S, [1]),
    "clear": lambda ix: ix.clear(S),
    "drop": lambda ix: ix.drop(S),
    "streams": lambda ix: ix.streams(),
    "longest_prefix": lambda ix: ix.longest_prefix([101], [S]),
    "stats": lambda ix: ix.stats(S),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_unreachable_redis_raises_index_unavailable(call: Callable[[RedisIndex], object]) -> None:
    index = RedisIndex(_no_retry_client(free_port()), SCHEMA)  # nothing listens there
    try:
        with pytest.raises(IndexUnavailableError, match="redis"):
            call(index)
    finally:
        index.close()


def test_index_works_again_when_redis_is_back() -> None:
    with running_redis() as server:
        index = RedisIndex(_no_retry_client(server.port), SCHEMA)
        try:
            index.apply(S, 0, 1.0, [store(1, 101)])
            server.stop()
            with pytest.raises(IndexUnavailableError):
                index.apply(S, 1, 1.0, [])
            server.restart()
            assert index.apply(S, 1, 2.0, [store(2, 102)]).applied
            assert index.streams() == [S]
        finally:
            index.close()


# --- seqs ---------------------------------------------------------------------------------


def test_the_watermark_is_stored_as_the_seqs_own_decimal_integer(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    seq = 3 * 10**18 + 7
    index.apply(S, seq, 1.0, [store(1, 101)])
    assert redis_client.hget(SCHEMA.stream(S).meta, META_WATERMARK) == str(seq).encode()


def test_a_float_watermark_left_by_older_code_reads_as_none_and_is_overwritten(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    redis_client.hset(SCHEMA.stream(S).meta, mapping={META_WATERMARK: "3e+18", "ts": "1.0"})
    assert index.stats(S).watermark == -1
    assert index.apply(S, 5, 2.0, [store(1, 101)]).applied
    assert index.stats(S).watermark == 5


@pytest.mark.latency_bound
@pytest.mark.parametrize("silent", [True, False], ids=["accepts-never-answers", "refuses"])
def test_a_bounded_client_fails_within_its_timeout(silent: bool) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        if silent:  # a stopped Redis: the kernel completes the handshake, nobody answers
            listener.listen(8)
        port = listener.getsockname()[1]
        index = RedisIndex(connect_bounded(f"redis://127.0.0.1:{port}/0", timeout_s=0.1))
        started = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            index.longest_prefix([1, 2], [StreamId("r1")])
        assert time.monotonic() - started < 0.3
        index.close()


# --- the identity marker: telling an emptied store ------------------------------------


def test_a_flushed_store_is_told_once_and_then_marked_again(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    assert index.intact()  # the first look adopts the store and marks it
    marker = redis_client.get(SCHEMA.index_marker)
    assert marker is not None
    index.apply(S, 0, 1.0, [store(1, 101)])
    assert index.intact()
    redis_client.flushall()
    assert not index.intact()
    assert index.intact()
    assert redis_client.get(SCHEMA.index_marker) not in (None, marker)


def test_a_loss_seen_first_by_another_process_is_still_told(redis_client: redis.Redis) -> None:
    first, second = RedisIndex(redis_client, SCHEMA), RedisIndex(redis_client, SCHEMA)
    assert first.intact() and second.intact()
    redis_client.flushall()
    assert not first.intact()  # it marks the store again...
    assert not second.intact()  # ...with a token the other has not seen
    assert first.intact() and second.intact()


def test_a_marked_store_opened_again_is_intact(redis_client: redis.Redis) -> None:
    assert RedisIndex(redis_client, SCHEMA).intact()
    assert RedisIndex(redis_client, SCHEMA).intact()  # an indexer restart: data kept


def test_a_refilled_stream_is_listed_again(index: RedisIndex, redis_client: redis.Redis) -> None:
    index.intact()
    index.apply(S, 0, 1.0, [store(1, 101)])
    redis_client.flushall()
    assert not index.intact()
    index.apply(S, 0, 1.0, [store(1, 101)])
    assert index.streams() == [S]


# --- on Redis Cluster (the session's 3-master cluster) --------------------------------------

FLEET = [StreamId(f"c{i}") for i in range(24)]


def _stored_fleet(client: RedisCluster) -> RedisIndex:
    index = RedisIndex(client, SCHEMA)
    for i, stream in enumerate(FLEET):
        index.apply(stream, 1, 1.0, [store(1, 101), store(2, 102)] if i % 2 else [store(1, 101)])
    return index


def _expected(keys: list[int]) -> dict[StreamId, PrefixMatch]:
    return {
        s: PrefixMatch((Tier.GPU,) * min(len(keys), 2 if i % 2 else 1)) for i, s in enumerate(FLEET)
    }


def _calls(cluster: ClusterNodes) -> dict[str, int]:
    """Calls per command, summed over the masters, since their last CONFIG RESETSTAT."""
    total: dict[str, int] = {}
    for port in cluster.ports:
        with cluster.node(port) as client:
            for name, stats in client.info("commandstats").items():
                total[name] = total.get(name, 0) + int(stats["calls"])
    return total


def test_a_cluster_lookup_is_one_script_per_group_and_asks_nothing_else(
    redis_cluster: ClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    index = _stored_fleet(redis_cluster_client)
    assert index.longest_prefix([101, 102], FLEET) == _expected([101, 102])  # scripts loaded
    for port in redis_cluster.ports:
        with redis_cluster.node(port) as client:
            client.config_resetstat()
    assert index.longest_prefix([101, 102, 103], FLEET) == _expected([101, 102, 103])
    groups = {SCHEMA.group_of(s) for s in FLEET}
    # a group reads 101 (one HGET), then 102 and 103 in one chunk (one HMGET), then its #gen
    calls = _calls(redis_cluster)
    assert calls.pop("cmdstat_config|resetstat") == len(redis_cluster.ports)
    calls.pop("cmdstat_hello", None)  # the connections _calls opened
    assert calls == {
        "cmdstat_evalsha": len(groups),
        "cmdstat_hmget": 2 * len(groups),  # a chunk, the #gen: its numbering is known
        "cmdstat_hget": len(groups),
    }
    assert len({redis_cluster.owner(key_slot(SCHEMA.group(g)[0].encode())) for g in groups}) > 1


def test_the_group_count_is_chosen_by_topology_unless_given(
    redis_client: redis.Redis, redis_cluster_client: RedisCluster
) -> None:
    assert RedisIndex(redis_client, Schema("t")).schema.index_groups == STANDALONE_INDEX_GROUPS
    on_cluster = RedisIndex(redis_cluster_client, Schema("t"))
    assert on_cluster.schema.index_groups == CLUSTER_INDEX_GROUPS
    on_cluster.apply(S, 0, 1.0, [store(1, 101)])
    members = on_cluster.schema.stream(S).members
    assert redis_cluster_client.hget(members, "#groups") == b"16"
    for client in (redis_client, redis_cluster_client):
        assert RedisIndex(client, Schema("t", 4)).schema.index_groups == 4  # the setting's


def test_a_cluster_lookup_after_every_master_flushed_its_scripts(
    redis_cluster_client: RedisCluster,
) -> None:
    index = _stored_fleet(redis_cluster_client)
    assert index.longest_prefix([101, 102], FLEET) == _expected([101, 102])
    redis_cluster_client.script_flush()
    assert index.longest_prefix([101, 102], FLEET) == _expected([101, 102])


def test_a_stream_whose_slot_moved_to_another_master_is_still_read_and_written(
    redis_cluster: ClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    index = _stored_fleet(redis_cluster_client)
    assert index.longest_prefix([101, 102], FLEET) == _expected([101, 102])
    moved = FLEET[1]
    slot = key_slot(SCHEMA.stream(moved).holders.encode())
    before = redis_cluster.owner(slot)
    assert redis_cluster.move_slot(slot) != before  # the client's slot map is now stale
    assert index.longest_prefix([101, 102], FLEET) == _expected([101, 102])
    assert index.apply(moved, 2, 2.0, [store(3, 103)]).applied
    assert index.longest_prefix([101, 102, 103], [moved]) == {moved: PrefixMatch((Tier.GPU,) * 3)}
    assert index.stats(moved).watermark == 2


def test_a_cluster_node_used_as_standalone_is_unavailable_with_the_fix_named(
    redis_cluster: ClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    """Before cluster support this was a MovedError that ended the process."""
    slot = key_slot(SCHEMA.stream(S).holders.encode())
    elsewhere = next(p for p in redis_cluster.ports if p != redis_cluster.owner(slot))
    standalone = connect(f"redis://127.0.0.1:{elsewhere}/0", cluster="off")
    index = RedisIndex(standalone, SCHEMA)
    with pytest.raises(IndexUnavailableError, match='set redis_cluster = "on"'):
        index.apply(S, 1, 1.0, [store(1, 101)])
    index.close()


# --- schema v3: versions, group counts, the groups' numbering -------------------------------


@pytest.mark.parametrize(
    "left", ["test:v1:streams", "test:v1:index", "test:v2:streams", "test:v2:index"]
)
def test_an_index_opened_on_older_data_refuses_with_the_fix_named(
    index: RedisIndex, redis_client: redis.Redis, left: str
) -> None:
    redis_client.set(left, "x") if left.endswith("index") else redis_client.sadd(left, "r1/0")
    version = left.split(":")[1]
    with pytest.raises(SchemaVersionError, match="older schema") as refused:
        index.intact()
    globs = " ".join(repr(g) for g in SCHEMA.old_index_globs(version))
    assert f"delete the old index keys (redis-cli --scan --pattern each of {globs};" in str(
        refused.value
    )
    with pytest.raises(SchemaVersionError, match="older schema"):  # the API's first lookup
        RedisIndex(redis_client, SCHEMA).longest_prefix([101], [S])
    assert not any(k.startswith(b"test:v3") for k in redis_client.scan_iter())
    redis_client.delete(left)
    assert index.intact()


def test_the_old_index_globs_match_the_old_index_keys_only(redis_client: redis.Redis) -> None:
    index_keys = {
        "v1": ["test:v1:streams", "test:v1:index", "test:v1:{r1/0}:keys", "test:v1:{r1/0}:meta"],
        "v2": [
            "test:v2:streams",
            "test:v2:index",
            "test:v2:{ix3}:holders",
            "test:v2:{ix3}:r1/0:hash",
        ],
    }
    kept = ["test:v1:{fleet}:replicas", "test:v1:{inflight}:totals", "test:v1:indexers"]
    kept += ["test:v2:{load}:loads", "test:v2:{load}:changes", "test:v3:streams"]
    for name in [*kept, *index_keys["v1"], *index_keys["v2"]]:
        redis_client.set(name, "x")
    for version, names in index_keys.items():
        globs = SCHEMA.old_index_globs(version)
        matched = {k.decode() for g in globs for k in redis_client.scan_iter(match=g)}
        assert matched == set(names), version


def test_the_first_process_names_the_group_count_and_another_count_is_refused_at_open(
    redis_client: redis.Redis,
) -> None:
    writer = RedisIndex(redis_client, Schema("test", 1))
    assert writer.intact()  # the indexer's start
    assert redis_client.get("test:v3:groups") == b"1"
    writer.apply(S, 0, 1.0, [store(1, 101)])
    reader = RedisIndex(redis_client, SCHEMA)
    elsewhere = next(s for s in (StreamId(f"e{i}") for i in range(100)) if SCHEMA.group_of(s))
    with pytest.raises(SchemaVersionError, match="written with 1 stream groups"):
        reader.check_schema()
    # its lookup would read groups the writer never wrote (no match): it refuses instead
    with pytest.raises(SchemaVersionError, match="this process uses 16"):
        reader.longest_prefix([101], [elsewhere])
    RedisIndex(redis_client, Schema("test", 1)).check_schema()  # the same count passes


def test_the_group_count_is_named_again_after_the_data_was_lost(
    redis_client: redis.Redis,
) -> None:
    index = RedisIndex(redis_client, SCHEMA)
    assert index.intact()
    redis_client.flushall()
    assert not index.intact()
    assert redis_client.get("test:v3:groups") == b"16"
    with pytest.raises(SchemaVersionError, match="16 stream groups"):
        RedisIndex(redis_client, Schema("test", 1)).check_schema()


def test_processes_with_another_group_count_are_refused(redis_client: redis.Redis) -> None:
    index = RedisIndex(redis_client, SCHEMA)
    assert index.intact()  # the indexer's start names the count
    index.apply(S, 0, 1.0, [store(1, 101)])
    other = RedisIndex(redis_client, Schema("test", index_groups=1))
    # the one group of a 1-group process is group 0, which a 16-group writer also uses
    writer = next(s for s in (StreamId(f"w{i}") for i in range(100)) if SCHEMA.group_of(s) == 0)
    index.apply(writer, 0, 1.0, [store(1, 101)])
    with pytest.raises(SchemaVersionError, match="16 stream groups"):
        other.apply(StreamId("elsewhere"), 0, 1.0, [store(1, 101)])
    with pytest.raises(SchemaVersionError, match="16 stream groups"):
        other.longest_prefix([101], [writer])
    assert index.longest_prefix([101], [S, writer]) == {
        S: PrefixMatch((Tier.GPU,)),
        writer: PrefixMatch((Tier.GPU,)),
    }


def _same_group(n: int) -> list[StreamId]:
    found = (s for s in (StreamId(f"n{i}") for i in range(1_000)) if SCHEMA.group_of(s) == 3)
    return [next(found) for _ in range(n)]


def test_a_number_freed_by_a_drop_and_reused_is_read_with_its_new_stream(
    redis_client: redis.Redis,
) -> None:
    writer, reader = RedisIndex(redis_client, SCHEMA), RedisIndex(redis_client, SCHEMA)
    old, kept, new = _same_group(3)
    writer.apply(old, 0, 1.0, [store(1, 101)])
    writer.apply(kept, 0, 1.0, [store(1, 101), store(2, 102)])
    assert reader.longest_prefix([101, 102], [old, kept, new]) == {
        old: PrefixMatch((Tier.GPU,)),
        kept: PrefixMatch((Tier.GPU, Tier.GPU)),
        new: PrefixMatch(),
    }
    writer.drop(old)
    writer.apply(new, 0, 1.0, [store(1, 101), store(2, 102, Tier.CPU)])  # old's number
    assert redis_client.hget(SCHEMA.stream(new).members, str(new)) == b"0"
    assert reader.longest_prefix([101, 102], [old, kept, new]) == {
        old: PrefixMatch(),
        kept: PrefixMatch((Tier.GPU, Tier.GPU)),
        new: PrefixMatch((Tier.GPU, Tier.CPU)),
    }


def test_a_numbering_lost_with_the_data_is_never_taken_for_the_one_before(
    redis_client: redis.Redis,
) -> None:
    writer, reader = RedisIndex(redis_client, SCHEMA), RedisIndex(redis_client, SCHEMA)
    first, second = _same_group(2)
    writer.apply(first, 0, 1.0, [store(1, 101)])
    writer.apply(second, 0, 1.0, [store(2, 201)])
    assert reader.longest_prefix([101], [first, second])[first] == PrefixMatch((Tier.GPU,))
    redis_client.flushall()  # the numbering goes too; the next one starts elsewhere
    writer.apply(second, 0, 1.0, [store(1, 101)])  # number 0 now, first's before
    assert reader.longest_prefix([101], [first, second]) == {
        first: PrefixMatch(),
        second: PrefixMatch((Tier.GPU,)),
    }


def test_a_lookup_reads_the_numbering_only_when_it_changed(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    a, b = _same_group(2)
    index.apply(a, 0, 1.0, [store(1, 101)])
    index.longest_prefix([101], [a, b])
    redis_client.config_resetstat()
    index.longest_prefix([101], [a, b])
    assert "hgetall" not in commands_run(redis_client)
    index.apply(b, 0, 1.0, [store(1, 101)])
    redis_client.config_resetstat()
    assert index.longest_prefix([101], [a, b]) == dict.fromkeys([a, b], PrefixMatch((Tier.GPU,)))
    assert "hgetall" in commands_run(redis_client)


def test_a_lookup_of_many_streams_is_one_script_on_standalone_redis(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    fleet = [StreamId(f"f{i}") for i in range(200)]
    for stream in fleet:
        index.apply(stream, 0, 1.0, [store(1, 101)])
    index.longest_prefix([101, 102], fleet)
    redis_client.config_resetstat()
    assert index.longest_prefix([101, 102], fleet) == dict.fromkeys(fleet, PrefixMatch((Tier.GPU,)))
    stats = redis_client.info("commandstats")
    groups = len({SCHEMA.group_of(s) for s in fleet})
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert stats["cmdstat_hget"]["calls"] == groups  # block 101
    assert stats["cmdstat_hmget"]["calls"] == 2 * groups  # a chunk from 102 (the miss), #gen


def test_bad_holder_records_never_crash_the_reader() -> None:
    assert holder_tiers(b"") == {}
    assert holder_tiers(b"\x00") == {}  # a torn record is ignored
    assert holder_tiers(record(5, 1) + record(9, 2)) == {5: 1, 9: 2}
    assert holder_tiers(bytes([0, 3, 0, 0, 0, 1, 0, 0])) == {0: 1}
    assert holder_tiers(record(2, 0) + bytes([0, 7, 0, 1])) == {2: 0}
    assert group_matches(b"") == {}


def _fleet_ops(i: int, prefix: list[int], chain: list[int]) -> list[Op]:
    """Stream i's blocks: the shared prefix (most streams; a few from block 1: a hole at 0,
    some on CPU), then a part of the chain of its own length, one block in three of the
    rest (never matched)."""
    tier = Tier.CPU if i % 5 == 0 else Tier.GPU
    held = prefix[1:] if i % 7 == 3 else prefix
    own = chain[: (i * 37) % len(chain)]
    rest = chain[len(own) + 1 :: 3]
    return [store(k, k, tier) for k in held] + [store(k, k) for k in own + rest]


def test_one_group_and_sixteen_answer_every_lookup_alike(redis_client: redis.Redis) -> None:
    # Holders of a shared prefix that leave it at every chunk edge of the walk, with one
    # group (every holder in one value) and the default 16, against the memory index.
    prefix, chain = list(range(1, 71)), list(range(1001, 1401))
    streams = [StreamId(f"s{i:02d}") for i in range(40)]
    indexes: list[BlockIndex] = [
        RedisIndex(redis_client, Schema("g16", CLUSTER_INDEX_GROUPS)),
        RedisIndex(redis_client, Schema("g1", index_groups=1)),
        MemoryIndex(),
    ]
    for i, stream in enumerate(streams):
        for index in indexes:
            index.apply(stream, 0, 1.0, _fleet_ops(i, prefix, chain))
    prompts = [prefix, prefix + chain, prefix[:33] + chain, chain, [prefix[0]]]
    for keys in prompts:
        expected = indexes[-1].longest_prefix(keys, streams)
        assert any(m.num_blocks > 100 for m in expected.values()) or keys != prefix + chain
        for index in indexes[:-1]:
            assert index.longest_prefix(keys, streams) == expected, (index, len(keys))
    for index in indexes:  # a holder's answer changes: the decoded one is not reused
        index.apply(streams[1], 1, 2.0, [(OpKind.REMOVE, Tier.GPU, prefix[40], 0)])
    for index in indexes[:-1]:
        assert index.longest_prefix(prefix, streams)[streams[1]] == PrefixMatch((Tier.GPU,) * 40)


def test_the_holders_are_answered_natively_in_runs_of_one_match(
    index: RedisIndex, redis_client: redis.Redis
) -> None:
    assert isinstance(index, HolderLookup)
    asked = [StreamId(f"h{i}") for i in range(40)]
    for i, stream in enumerate(asked[:30]):  # 10 hold 2 blocks on GPU, 20 hold one
        index.apply(stream, 0, 1.0, [store(1, 101), *([store(2, 102)] if i % 3 == 0 else [])])
    first = index.holders([101, 102], asked)
    again = index.holders([101, 102], asked)  # the same answer of Redis: made once
    assert first == again and first is not again
    assert sorted(i for _, run in first for i in run) == list(range(30))
    two = [run for match, run in first if match == PrefixMatch((Tier.GPU, Tier.GPU))]
    assert sorted(i for run in two for i in run) == list(range(0, 30, 3))
    assert len(first) <= 2 * len({SCHEMA.group_of(s) for s in asked})  # a run per match and group
    index.apply(asked[1], 1, 2.0, [store(2, 102)])  # the answer changes: made again
    changed = index.holders([101, 102], asked)
    assert {i for match, run in changed for i in run if match.num_blocks == 2} == {
        *range(0, 30, 3),
        1,
    }
