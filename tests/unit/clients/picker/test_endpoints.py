from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2

from kvindex.clients.picker.endpoints import EndpointBook, endpoint_of, served_in, subset_of
from kvindex.indexer.fleet.replica import ReplicaSpec


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7:8000"),
        ("http://10.0.0.7:8000/v1/", "10.0.0.7:8000"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("https://pod.local", "pod.local:443"),
        ("http://[fd00::1]:8001", "[fd00::1]:8001"),
        ("http://10.0.0.7:99999", None),
        ("", None),
        (None, None),
    ],
)
def test_a_replicas_endpoint_is_its_urls_ip_and_port(url: str | None, endpoint: str | None) -> None:
    assert endpoint_of(url) == endpoint


def _spec(rid: str, url: str | None) -> ReplicaSpec:
    return ReplicaSpec(rid, "m", events="tcp://127.0.0.1:5557", url=url)


def test_the_book_maps_both_ways_and_data_parallel_ranks_by_port() -> None:
    book = EndpointBook().update(
        [_spec("a0", "http://10.0.0.7:8000"), _spec("a1", "http://10.0.0.7:8001"), _spec("b", None)]
    )
    assert book.replica_to_endpoint == {"a0": "10.0.0.7:8000", "a1": "10.0.0.7:8001"}
    assert book.endpoint_to_replica["10.0.0.7:8001"] == "a1"


def _metadata(namespace: str, key: str, value: object) -> object:
    metadata = base_pb2.Metadata()
    fields = metadata.filter_metadata[namespace].fields
    if isinstance(value, list):
        fields[key].list_value.extend(value)
    else:
        fields[key].string_value = str(value)
    return metadata


def test_the_subset_hint_as_a_list_or_a_comma_separated_string() -> None:
    hint = ("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset")
    assert subset_of(_metadata(*hint, ["1.1.1.1:80", "2.2.2.2:80"])) == frozenset(
        {"1.1.1.1:80", "2.2.2.2:80"}
    )
    assert subset_of(_metadata(*hint, "1.1.1.1:80, 2.2.2.2:80")) == frozenset(
        {"1.1.1.1:80", "2.2.2.2:80"}
    )
    assert subset_of(_metadata(*hint, [])) == frozenset()
    assert subset_of(base_pb2.Metadata()) is None
    assert subset_of(_metadata("envoy.lb.subset_hint", "other", [])) is None


def test_the_served_endpoint() -> None:
    served = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", "1.1.1.1:80")
    assert served_in(served) == "1.1.1.1:80"
    assert served_in(base_pb2.Metadata()) is None
