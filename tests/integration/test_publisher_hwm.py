"""The fake publisher's send high-water mark over real ZeroMQ: a subscriber that stops
reading loses frames live (a gap in seqs), and every one of them stays in the replay buffer."""

from __future__ import annotations

import time

import zmq

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, Tier
from kvindex.indexer.ingest.replay import fetch_replay
from kvindex.indexer.ingest.wire import decode_seq

NUM_FRAMES = 1000
BIG = BlockStored(tuple(range(64)), None, [70_000 + i for i in range(64 * 16)], 16, Tier.GPU)
"""About 4 KB a batch, 4 MB in all: far past a 4 KB send buffer, a one-message HWM and a
subscriber's 4 KB receive buffer."""

Context = zmq.Context[zmq.Socket[bytes]]


def _subscriber(context: Context, endpoint: str) -> zmq.Socket[bytes]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _joined(pub: EventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish until one frame arrives (ZeroMQ's slow joiner), drain; the next seq."""
    deadline = time.monotonic() + 5
    seq = 0
    while not sub.poll(50):
        assert time.monotonic() < deadline, "subscriber never joined"
        seq = pub.publish([])
    while sub.poll(100):
        sub.recv_multipart()
    return seq + 1


def _received_seqs(sub: zmq.Socket[bytes]) -> list[int]:
    seqs = []
    while sub.poll(300):
        seqs.append(decode_seq(sub.recv_multipart()[1]))
    return seqs


def test_frames_past_the_send_hwm_are_dropped_live_and_kept_for_replay() -> None:
    context: Context = zmq.Context()
    pub = EventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        topic="kv@r1@M",
        context=context,
        send_hwm=1,
        send_buffer_bytes=4096,
    )
    sub = _subscriber(context, pub.endpoint)
    try:
        first = _joined(pub, sub)
        seqs = [pub.publish([BIG]) for _ in range(NUM_FRAMES)]
        assert seqs[0] == first
        pub.flush()
        received = _received_seqs(sub)
        assert len(received) < NUM_FRAMES // 2, "nothing was dropped"
        assert set(received) <= set(seqs)
        assert pub.replay_endpoint is not None
        replayed = fetch_replay(context, pub.replay_endpoint, first, timeout_s=5)
        assert [b.seq for b in replayed] == seqs  # every dropped frame kept for replay
    finally:
        sub.close(linger=0)
        pub.close()
        context.term()
