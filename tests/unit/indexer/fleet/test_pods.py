"""Pods as replicas: ranks from the ports, ports from the annotations, the model's fallbacks,
who is routable, and pods that cannot be mapped (named in the error)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvindex.indexer.fleet.pods import (
    InferencePool,
    Pod,
    PodError,
    Target,
    WatchEvent,
    pool_target,
    replica_id,
    replicas_of,
    routable,
)
from kvindex.indexer.fleet.replica import ReplicaSpec
from tests.support.kube_api import pod as pod_object


def _pod(name: str = "vllm-0", ip: str = "10.1.2.3", **kw: Any) -> Pod:
    return msgspec.convert(pod_object(name, ip, **kw), Pod)


def test_one_port_is_one_replica_named_as_its_pod_with_vllm_default_events_port() -> None:
    (spec,) = replicas_of(_pod(), (8000,), "m")
    assert spec == ReplicaSpec(
        "vllm-0", "m", events="tcp://10.1.2.3:5557", replay=None, url="http://10.1.2.3:8000"
    )


def test_data_parallel_ranks_are_the_ports_in_order_with_events_and_replay_offset() -> None:
    annotations = {"kvindex.io/events-port": "6000", "kvindex.io/replay-port": "7000"}
    specs = replicas_of(_pod(annotations=annotations), (8000, 8001, 8002), "m")
    assert [s.id for s in specs] == ["vllm-0", "vllm-0-1", "vllm-0-2"]
    assert [s.url for s in specs] == [f"http://10.1.2.3:{p}" for p in (8000, 8001, 8002)]
    assert [s.events for s in specs] == [f"tcp://10.1.2.3:{p}" for p in (6000, 6001, 6002)]
    assert [s.replay for s in specs] == [f"tcp://10.1.2.3:{p}" for p in (7000, 7001, 7002)]
    assert all(s.dp_size == 1 for s in specs)  # each rank its own replica, as GIE sees them


def test_the_model_annotation_wins_over_the_label_and_the_label_over_the_default() -> None:
    label = {"app": "vllm", "kvindex.io/model": "from-label"}
    annotated = _pod(labels=label, annotations={"kvindex.io/model": "from-annotation"})
    assert replicas_of(annotated, (8000,), "default")[0].model == "from-annotation"
    assert replicas_of(_pod(labels=label), (8000,), "default")[0].model == "from-label"
    assert replicas_of(_pod(), (8000,), "default")[0].model == "default"


def test_an_ipv6_pod_address_is_bracketed() -> None:
    (spec,) = replicas_of(_pod(ip="fd00::1"), (8000,), "m")
    assert spec.url == "http://[fd00::1]:8000"
    assert spec.events == "tcp://[fd00::1]:5557"


def test_a_pod_not_ready_unaddressed_or_being_deleted_makes_no_replica() -> None:
    assert replicas_of(_pod(ready=False), (8000,), "m") == ()
    assert replicas_of(_pod(ip=""), (8000,), "m") == ()
    deleting = _pod()
    deleting = msgspec.structs.replace(
        deleting,
        metadata=msgspec.structs.replace(
            deleting.metadata, deletion_timestamp="2026-01-01T00:00:00Z"
        ),
    )
    assert not routable(deleting)
    assert replicas_of(deleting, (8000,), "m") == ()
    assert routable(_pod())


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({}, "no kvindex.io/model annotation or label"),
        ({"annotations": {"kvindex.io/model": "m", "kvindex.io/events-port": "x"}}, "events-port"),
        ({"annotations": {"kvindex.io/model": "m", "kvindex.io/replay-port": "0"}}, "replay-port"),
        ({"annotations": {"kvindex.io/model": "m", "kvindex.io/events-port": "65535"}}, "65535"),
        ({"annotations": {"kvindex.io/model": "m"}, "ip": "not-an-ip"}, "podIP"),
    ],
)
def test_a_pod_that_cannot_be_mapped_is_named_with_what_is_wrong(
    kw: dict[str, Any], named: str
) -> None:
    with pytest.raises(PodError, match=named) as caught:
        replicas_of(_pod(name="bad-pod", **kw), (8000, 8001), "")
    assert "bad-pod" in str(caught.value)


def test_replica_ids() -> None:
    assert replica_id("p", 0) == "p"
    assert replica_id("p", 3) == "p-3"


def test_a_pool_names_its_selector_and_ports() -> None:
    raw = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "spec": {
            "selector": {"matchLabels": {"b": "2", "a": "1"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "kvindex", "port": {"number": 9002}},
        },
    }
    pool = msgspec.json.decode(msgspec.json.encode(raw), type=InferencePool)
    assert pool_target(pool) == Target("a=1,b=2", (8000, 8001))


@pytest.mark.parametrize(
    "spec",
    [
        {"targetPorts": [{"number": 8000}]},
        {"selector": {"matchLabels": {"a": "1"}}, "targetPorts": []},
        {"selector": {"matchLabels": {"a": "1"}}, "targetPorts": [{"number": p} for p in range(9)]},
    ],
)
def test_a_pool_without_labels_or_with_a_bad_port_count_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(PodError):
        pool_target(msgspec.convert({"spec": spec}, InferencePool))


def test_a_watch_event_keeps_its_object_raw_for_its_type() -> None:
    line = b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired"}}'
    event = msgspec.json.decode(line, type=WatchEvent)
    assert event.type == "ERROR"
    assert b"410" in bytes(event.object)
