"""Redis key names: layout, version, hash tags and name validation (no server needed)."""

from __future__ import annotations

import dataclasses

import pytest
from redis.crc import key_slot

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.redis.schema import (
    CLUSTER_INDEX_GROUPS,
    DEFAULT_PREFIX,
    INDEX_VERSION,
    META_TIER_PREFIX,
    META_TS,
    META_WATERMARK,
    SCHEMA_VERSION,
    STANDALONE_INDEX_GROUPS,
    TOPOLOGY_INDEX_GROUPS,
    Schema,
    SchemaError,
    StreamKeys,
    check_name,
    tokens_field,
)


def test_version_and_default_prefix() -> None:
    assert (SCHEMA_VERSION, INDEX_VERSION) == ("v1", "v3")
    assert DEFAULT_PREFIX == "kvindex"
    assert Schema() == Schema(DEFAULT_PREFIX)


def test_root_and_streams_set_names() -> None:
    assert Schema().root == "kvindex:v1"
    assert Schema().index_root == "kvindex:v3"
    assert Schema().streams == "kvindex:v3:streams"
    assert Schema("fleet-a").streams == "fleet-a:v3:streams"
    assert Schema().index_marker == "kvindex:v3:index"
    assert Schema().index_groups_key == "kvindex:v3:groups"


def test_stream_key_names() -> None:
    stream = StreamId("r1", 2)
    schema = Schema("p", CLUSTER_INDEX_GROUPS)
    g = schema.group_of(stream)
    keys = schema.stream(stream)
    own = f"p:v3:{{ix{g}}}:r1/2"
    assert keys == StreamKeys(
        meta=f"{own}:meta",
        hashes=f"{own}:hash",
        lost=f"{own}:lost",
        holders=f"p:v3:{{ix{g}}}:holders",
        members=f"p:v3:{{ix{g}}}:members",
    )
    assert schema.group(g) == (keys.holders, keys.members)


def test_all_is_in_the_order_apply_batch_lua_reads() -> None:
    keys = Schema(index_groups=1).stream(StreamId("r1"))
    assert keys.all() == (keys.meta, keys.hashes, keys.lost, keys.holders, keys.members)
    assert keys.own() == (keys.meta, keys.hashes, keys.lost)


def test_a_stream_group_is_a_pure_function_of_its_name_and_the_group_count() -> None:
    stream = StreamId("pod-3", 1)
    assert Schema("a", 16).group_of(stream) == Schema("b", 16).group_of(stream)
    assert 0 <= Schema(index_groups=5).group_of(stream) < 5
    assert Schema(index_groups=1).group_of(stream) == 0


def test_the_group_count_is_by_topology_unless_given() -> None:
    assert Schema().index_groups == TOPOLOGY_INDEX_GROUPS == 0
    assert Schema("p").for_topology(cluster=False) == Schema("p", STANDALONE_INDEX_GROUPS)
    assert Schema("p").for_topology(cluster=True) == Schema("p", CLUSTER_INDEX_GROUPS)
    assert (STANDALONE_INDEX_GROUPS, CLUSTER_INDEX_GROUPS) == (1, 16)
    for cluster in (False, True):
        assert Schema("p", 4).for_topology(cluster=cluster) == Schema("p", 4)


def test_a_schema_without_its_group_count_names_no_index_key() -> None:
    with pytest.raises(SchemaError, match="not chosen"):
        Schema("p").stream(StreamId("r1"))
    assert Schema("p").streams == "p:v3:streams"  # the keys outside the groups need none


@pytest.mark.parametrize("groups", [-1, 1025])
def test_a_bad_group_count_raises_schema_error(groups: int) -> None:
    with pytest.raises(SchemaError, match="index groups"):
        Schema(index_groups=groups)


def test_the_old_index_keys_are_the_v1_and_v2_streams_sets_and_markers() -> None:
    assert Schema("p").old_index_keys() == [
        "p:v1:streams",
        "p:v1:index",
        "p:v2:streams",
        "p:v2:index",
    ]


def test_the_old_index_globs_name_each_versions_streams_and_groups_keys() -> None:
    assert Schema("p").old_index_globs("v1") == ["p:v1:streams", "p:v1:index", "p:v1:{*/*}:*"]
    assert Schema("p").old_index_globs("v2") == ["p:v2:streams", "p:v2:index", "p:v2:{ix*}:*"]


def test_meta_field_names() -> None:
    assert (META_WATERMARK, META_TS, META_TIER_PREFIX) == ("wm", "ts", "n")


@pytest.mark.parametrize("stream", [StreamId("r1"), StreamId("r1", 7), StreamId("a.b:c-d_e", 3)])
def test_stream_keys_share_the_group_hash_slot(stream: StreamId) -> None:
    schema = Schema("p", CLUSTER_INDEX_GROUPS)
    slots = {key_slot(name.encode()) for name in schema.stream(stream).all()}
    assert slots == {key_slot(f"ix{schema.group_of(stream)}".encode())}


def test_hash_tag_ignores_the_prefix() -> None:
    stream = StreamId("r1", 1)
    a, b = Schema("a", CLUSTER_INDEX_GROUPS), Schema("b", CLUSTER_INDEX_GROUPS)
    assert a.stream(stream).meta != b.stream(stream).meta
    assert key_slot(a.stream(stream).meta.encode()) == key_slot(b.stream(stream).meta.encode())


@pytest.mark.parametrize("prefix", ["kvindex", "a", "fleet.prod-1", "team_x:kv", "X9"])
def test_good_prefixes_are_accepted(prefix: str) -> None:
    assert Schema(prefix).prefix == prefix


@pytest.mark.parametrize(
    "prefix", ["", "a b", "a{b", "a}b", "{a}", "a/b", "kv\n", "kv\r", "kvé", "a*", "a\x00"]
)
def test_bad_prefixes_raise_schema_error(prefix: str) -> None:
    with pytest.raises(SchemaError, match="key prefix"):
        Schema(prefix)


@pytest.mark.parametrize("name", ["r1", "replica-0.pod:8000", "A_B"])
def test_check_name_returns_a_good_name(name: str) -> None:
    assert check_name("replica id", name) == name


@pytest.mark.parametrize("name", ["", "r{1", "r}1", "r/1", "r 1", "r1\n", "\nr1"])
def test_check_name_names_the_kind_and_the_value(name: str) -> None:
    with pytest.raises(SchemaError) as info:
        check_name("replica id", name)
    assert "replica id" in str(info.value)
    assert repr(name) in str(info.value)


def test_schema_error_is_a_kvindex_error() -> None:
    assert issubclass(SchemaError, KvIndexError)


def test_schema_is_frozen() -> None:
    schema = Schema("p")
    with pytest.raises(dataclasses.FrozenInstanceError):
        schema.prefix = "q"  # type: ignore[misc]


def test_the_in_flight_keys_share_one_hash_slot() -> None:
    schema = Schema("p")
    assert (schema.in_flight, schema.leases) == ("p:v1:{inflight}:totals", "p:v1:{inflight}:leases")
    assert schema.lease("123-ab") == "p:v1:{inflight}:lease:123-ab"
    slots = {key_slot(k.encode()) for k in (schema.in_flight, schema.leases, schema.lease("h"))}
    assert len(slots) == 1
    assert tokens_field("r1") == "r1/tokens"
    with pytest.raises(SchemaError):
        schema.lease("a{b}")
