"""Readiness polling over many ZeroMQ sockets, costing the ready ones, not all registered."""

from __future__ import annotations

import select

import zmq

Socket = zmq.Socket[bytes]


def _int_option(sock: Socket, option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)
    return value


class ReadablePoller:
    """``zmq.Poller``'s register / unregister / poll for readability over an epoll of each
    socket's ``ZMQ_FD``, checked by ``ZMQ_EVENTS``. A socket reported readable is checked
    again at the next poll until it is not, so no wake-up is lost. One thread."""

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
        """The readable sockets, waiting up to ``timeout_ms`` (not while one is unchecked)."""
        timeout_s = 0.0 if self._unchecked else timeout_ms / 1000
        for fd, _ in self._epoll.poll(timeout_s):
            sock = self._socket_of.get(fd)
            if sock is not None:
                self._unchecked.add(sock)
        ready = [s for s in self._unchecked if _int_option(s, zmq.EVENTS) & zmq.POLLIN]
        self._unchecked = set(ready)
        return ready

    def close(self) -> None:
        self._socket_of.clear()
        self._unchecked.clear()
        self._epoll.close()
