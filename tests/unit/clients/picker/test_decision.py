"""The endpoint choice on the real scorer, memory index and registry (no services): the
proxy's ranking as endpoints, the subset hint, the ejected left out, each refusal's status."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.score import Scorer
from kvindex.api.tokenize.protocol import Tokenizer
from kvindex.clients.picker.decision import Decision, EndpointChooser, RefusalError
from kvindex.clients.proxy.upstream import UpstreamPicker
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry, RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HealthPolicy
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind
from tests.unit.clients.proxy.test_upstream import WordTokenizer

MODEL = "m"
URLS = {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.1:8001", "c": "http://10.0.0.2:8000"}
ENDPOINTS = {"a": "10.0.0.1:8000", "b": "10.0.0.1:8001", "c": "10.0.0.2:8000"}
PROMPT = " ".join(f"word{i}" for i in range(48))


class Fleet:
    """Replicas a and b (two ranks of one pod) and c, of one model; d with no url."""

    def __init__(self, num_endpoints: int = 3) -> None:
        specs = [ReplicaSpec(r, MODEL, url=u) for r, u in URLS.items()]
        self.registry = Registry((*specs, ReplicaSpec("d", MODEL)), clock=time.time)
        self.index = MemoryIndex()
        self.tokenizer = WordTokenizer()
        tokenizer: Tokenizer = self.tokenizer
        scorer = Scorer(
            ApiSettings(seed=1),
            self.index,
            self.registry,
            MemoryLoadStore(),
            tokenizers=lambda model: tokenizer if model == MODEL else None,
            blocking_store=False,
        )
        self.policy = HealthPolicy()

        def upstreams_over(registry: RegistryView) -> UpstreamPicker:
            return UpstreamPicker(scorer, registry, health_policy=self.policy)

        self.chooser = EndpointChooser(
            upstreams_over, self.registry, num_endpoints=num_endpoints, health_policy=self.policy
        )

    def hold(self, replica: str) -> None:
        keys = block_keys(MODEL, self.tokenizer._tokens(PROMPT), 16)
        ops: list[Op] = [(OpKind.STORE, Tier.GPU, i, k) for i, k in enumerate(keys)]
        self.index.apply(StreamId(replica), 0, time.time(), ops)
        self.registry.record(StreamId(replica), StreamReport(last_seq=0, last_event_ts=time.time()))

    def eject(self, replica: str) -> None:
        now, policy = time.time(), self.policy
        self.registry.update_health(
            {replica: lambda h: h.breaker_opened(now, policy, "status_502")}
        )

    def choose(self, body: object, subset: set[str] | None = None) -> Decision:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        hint = None if subset is None else frozenset(subset)
        return asyncio.run(self.chooser.choose(raw, {}, hint))


BODY = {"model": MODEL, "prompt": PROMPT}


def test_the_holder_first_then_the_rest_as_endpoints() -> None:
    fleet = Fleet()
    fleet.hold("b")
    decision = fleet.choose(BODY)
    assert decision.endpoints[0] == ENDPOINTS["b"] and decision.replicas[0] == "b"
    assert set(decision.endpoints) == set(ENDPOINTS.values())  # d has no url: never named
    assert decision.num_uncached_tokens == 0
    assert len(Fleet(num_endpoints=1).choose(BODY).endpoints) == 1


def test_the_subset_hint_keeps_the_choice_inside_it() -> None:
    fleet = Fleet()
    fleet.hold("b")
    decision = fleet.choose(BODY, {ENDPOINTS["a"], ENDPOINTS["c"]})
    assert set(decision.endpoints) == {ENDPOINTS["a"], ENDPOINTS["c"]}
    for subset in ({"10.9.9.9:80"}, set()):
        with pytest.raises(RefusalError) as refused:
            fleet.choose(BODY, subset)
        assert (refused.value.status, refused.value.outcome) == (503, "subset_miss")


def test_the_ejected_are_left_out_and_none_left_is_503() -> None:
    fleet = Fleet()
    fleet.hold("b")
    fleet.eject("b")
    assert ENDPOINTS["b"] not in fleet.choose(BODY).endpoints
    fleet.eject("a")
    fleet.eject("c")
    for body in (BODY, b""):
        with pytest.raises(RefusalError) as refused:
            fleet.choose(body)
        assert (refused.value.status, refused.value.outcome) == (503, "no_endpoint")


def test_no_body_is_routed_on_load_one_further_each_time() -> None:
    fleet = Fleet()
    firsts = {fleet.choose(b"").endpoints[0] for _ in range(3)}
    assert firsts == set(ENDPOINTS.values())


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{oops", 400),
        (b'"a string"', 400),
        ({"prompt": "no model"}, 400),
        ({"model": MODEL, "prompt": "a", "top_k": "x"}, 200),
        ({"model": "other", "prompt": "a"}, 404),
        (b"[" * 80 + b"]" * 80, 400),
    ],
)
def test_what_cannot_be_routed_is_refused_with_its_status(body: object, status: int) -> None:
    fleet = Fleet()
    if status == 200:
        assert fleet.choose(body).endpoints
        return
    with pytest.raises(RefusalError) as refused:
        fleet.choose(body)
    assert refused.value.status == status
