"""The replay client (built from the spec) against a real ZeroMQ ROUTER."""

from __future__ import annotations

import pytest
import zmq

from kvindex.indexer.domain.events import BlockStored, Tier
from kvindex.indexer.ingest.replay import ReplayTimeoutError, fetch_replay
from kvindex.indexer.ingest.wire import ReplayLayout
from tests.integration.harness import publisher_at

STORE = BlockStored((1, 2), None, list(range(32)), 16, Tier.GPU)


@pytest.mark.parametrize("layout", ["topic", "legacy"])
def test_replay_returns_buffered_batches_in_order(layout: ReplayLayout) -> None:
    pub = publisher_at(None, None, replay_layout=layout)
    try:
        for _ in range(5):
            pub.publish([STORE])
        pub.flush()
        assert pub.replay_endpoint is not None
        batches = fetch_replay(zmq.Context.instance(), pub.replay_endpoint, 2, timeout_s=2)
        assert [b.seq for b in batches] == [2, 3, 4]
        assert batches[0].events == (STORE,)
        assert fetch_replay(zmq.Context.instance(), pub.replay_endpoint, 99, timeout_s=2) == []
    finally:
        pub.close()


def test_replay_starts_at_the_oldest_buffered_batch() -> None:
    pub = publisher_at(None, None, buffer_steps=2)
    try:
        for _ in range(5):
            pub.publish([STORE])
        pub.flush()
        assert pub.replay_endpoint is not None
        batches = fetch_replay(zmq.Context.instance(), pub.replay_endpoint, 0, timeout_s=2)
        assert [b.seq for b in batches] == [3, 4]  # history before 3 is gone
    finally:
        pub.close()


def test_silent_router_times_out() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ReplayTimeoutError):
            fetch_replay(context, f"tcp://127.0.0.1:{port}", 0, timeout_s=0.2)
    finally:
        router.close(linger=0)
