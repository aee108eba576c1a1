"""ReplicaSpec: parsing, validation that names the bad value, endpoints per rank."""

from __future__ import annotations

import pytest

from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec, endpoint_for_rank, replica_from_mapping


def test_parse_reads_every_key_and_the_dp_alias() -> None:
    spec = ReplicaSpec.parse("id=r1, model=m, events=tcp://h:5557, replay=tcp://h:5558, dp=2")
    assert spec == ReplicaSpec("r1", "m", events="tcp://h:5557", replay="tcp://h:5558", dp_size=2)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("id=r1", "model is required"),
        ("id=r1,model=m,colour=red", "unknown keys ['colour']"),
        ("id=r1,model=m,dp_size=two", "dp_size must be an integer, got 'two'"),
        ("id=r1,model=m,dp_size=0", "dp_size must be in [1, 1024], got 0"),
        ("id=r1,model=m,dp_size=1025", "dp_size must be in [1, 1024], got 1025"),
        (f"id=r1,model=m,dp_size={2**40}", f"dp_size must be in [1, 1024], got {2**40}"),
        ("id=r1,model=m,events=http://h:1", "r1: events must be a ZeroMQ endpoint"),
        ("id=r1,model=m,url=file:///etc/passwd", "r1: url must be an http:// or https:// URL"),
        ("id=r1,model=m,url=gopher://h:70", "r1: url must be an http:// or https:// URL"),
        ("id=r1,model=m,url=http://", "r1: url must be an http:// or https:// URL"),
        ("id=r1,model=m,url=http://h:99999", "r1: url must be an http:// or https:// URL"),
        ("id=r/1,model=m", "replica id"),
        ("id=r1,model", "expected key=value, got 'model'"),
    ],
)
def test_a_bad_spec_names_what_is_wrong(text: str, named: str) -> None:
    with pytest.raises(SettingsError) as raised:
        ReplicaSpec.parse(text)
    assert named in str(raised.value)


def test_each_rank_publishes_on_the_next_port() -> None:
    spec = ReplicaSpec("r1", "m", events="tcp://h:5557", replay="tcp://h:6000", dp_size=2)
    assert (spec.events_for_rank(1), spec.replay_for_rank(1)) == ("tcp://h:5558", "tcp://h:6001")
    assert ReplicaSpec("r2", "m").events_for_rank(1) is None
    assert endpoint_for_rank("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(SettingsError, match="rank 1"):
        endpoint_for_rank("tcp://h:0", 1)


def test_a_mapping_from_toml_takes_an_integer_dp_size() -> None:
    spec = replica_from_mapping({"id": "r1", "model": "m", "dp_size": 3}, where="replicas[0]")
    assert spec.dp_size == 3


def test_http_and_https_urls_are_accepted() -> None:
    assert ReplicaSpec("r1", "m", url="https://h:8443/v").url == "https://h:8443/v"
    assert ReplicaSpec("r1", "m", url="http://[::1]:8000").url == "http://[::1]:8000"
