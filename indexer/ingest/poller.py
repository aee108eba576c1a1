"""Readiness polling over many ZeroMQ sockets at the cost of the ready ones."""

from __future__ import annotations

import select

import zmq

Socket = zmq.Socket[bytes]


def _int_option(sock: Socket, option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)
    return value


class ReadablePoller:
    """``zmq.Poller``'s register / unregister / poll for readability, costing the sockets that
    are ready rather than every socket registered: with thousands of streams a
    ``zmq.Poller.poll`` walks every socket each turn (9-16 ms for 4,000 here, 0.2 ms this way).

    An epoll watches each socket's ``ZMQ_FD``, which signals when the socket's state may have
    changed; ``ZMQ_EVENTS`` then says whether it is readable. A socket reported readable is
    checked again at the next poll (without waiting) until it is not, so a caller that stops
    draining early, or that sends on it, loses no wake-up. Used from one thread; a socket is
    unregistered before it is closed."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._socket_of: dict[int, Socket] = {}
        self._unchecked: set[Socket] = set()

    @property
    def sockets(self) -> list[Socket]:
        return list(self._socket_of.values())

    def register(self, sock: Socket) -> None:
        fd = _int_option(sock, zmq.FD)
        self._epoll.register(fd, select.EPOLLIN)
        self._socket_of[fd] = sock
        self._unchecked.add(sock)  # it may hold messages already

    def unregister(self, sock: Socket) -> None:
        fd = _int_option(sock, zmq.FD)
        self._epoll.unregister(fd)
        del self._socket_of[fd]
        self._unchecked.discard(sock)

    def poll(self, timeout_ms: int) -> list[Socket]:
        """The readable sockets, waiting up to ``timeout_ms`` for one (not at all while a
        socket reported last time is still to be checked)."""
        timeout_s = 0.0 if self._unchecked else timeout_ms / 1000
        for fd, _ in self._epoll.poll(timeout_s):
            sock = self._socket_of.get(fd)
            if sock is not None:
                self._unchecked.add(sock)
        ready = [s for s in self._unchecked if _int_option(s, zmq.EVENTS) & zmq.POLLIN]
        self._unchecked = set(ready)
        return ready

    def close(self) -> None:
        """Stop watching (every socket should be unregistered by now); idempotent."""
        self._socket_of.clear()
        self._unchecked.clear()
        self._epoll.close()
