"""Subscriber: the socket loop's own behaviour (these tests open no connection)."""

from __future__ import annotations

import time

import zmq

from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.settings import IndexerSettings
from kvindex.indexer.subscriber import Subscriber


def test_a_loop_with_no_socket_to_poll_waits_instead_of_spinning() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subscriber = Subscriber(IndexerSettings(), MemoryIndex(), Registry(()), context=context)
    subscriber.start()  # no replica, no bind: nothing to poll
    try:
        cpu_before = time.process_time()
        time.sleep(1.0)
        # The process's CPU over 1 s is the loop thread's (this one sleeps): a spinning
        # loop burns about 1 s of it, a waiting one next to nothing.
        assert time.process_time() - cpu_before < 0.3
    finally:
        subscriber.stop()
        context.term()
