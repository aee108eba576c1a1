"""ReadablePoller: wakes for the ready sockets alone, and loses no wake-up."""

from __future__ import annotations

import time

import zmq

from kvindex.indexer.ingest.poller import ReadablePoller

Context = zmq.Context[zmq.Socket[bytes]]


def test_the_poller_reports_a_socket_until_it_is_drained_and_wakes_on_the_next_message() -> None:
    context: Context = zmq.Context()
    pusher, puller = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    pusher.bind("inproc://poller-test")
    puller.connect("inproc://poller-test")
    idle = context.socket(zmq.PAIR)
    poller = ReadablePoller()
    try:
        poller.register(puller)
        poller.register(idle)
        assert poller.poll(0) == [] and set(poller.sockets) == {puller, idle}
        for i in range(3):
            pusher.send(bytes([i]))
        assert poller.poll(1000) == [puller]
        puller.recv()  # a drain that stops early: reported again, at once
        started = time.monotonic()
        assert poller.poll(5000) == [puller] and time.monotonic() - started < 1
        puller.recv()
        puller.recv()
        started = time.monotonic()
        assert poller.poll(5000) == [] and time.monotonic() - started < 1  # checked: empty
        started = time.monotonic()
        assert poller.poll(200) == [] and time.monotonic() - started >= 0.15  # it waits
        pusher.send(b"again")
        assert poller.poll(5000) == [puller]  # a new message wakes it
        poller.unregister(puller)
        assert poller.poll(0) == [] and poller.sockets == [idle]
    finally:
        poller.close()
        for sock in (pusher, puller, idle):
            sock.close(linger=0)
        context.term()
