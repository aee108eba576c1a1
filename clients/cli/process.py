"""The life of a long-running command: its port tried before it says where it listens, its
one line on stdout, then SIGTERM or SIGINT awaited."""

from __future__ import annotations

import errno
import signal
import socket
import threading
from typing import TYPE_CHECKING

import click

from kvindex.indexer.domain.errors import KvIndexError

if TYPE_CHECKING:
    from kvindex.indexer.config.settings import IndexerSettings


def check_port(host: str, port: int, option: str = "--port") -> None:
    """A one-line :class:`click.ClickException` naming ``option`` unless ``host:port`` can be
    listened on now (port 0, any free one, is not tried)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"port {port} on {host} is in use: choose another with {option}"
            ) from None
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def say(line: str) -> None:
    """``line`` on stdout as given: no console library loaded for it (a start-up's cost), and
    none of its markup read in it (an IPv6 ``[::1]`` stays)."""
    click.echo(line)


def stop_event() -> threading.Event:
    """An event that SIGTERM and SIGINT set."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def run_indexer(settings: IndexerSettings, stats_every: float) -> None:
    """``kvindex indexer``: the write path and its status line until a signal."""
    from kvindex.clients.cli.status import StatusLog, fleet_status
    from kvindex.indexer.service import IndexerService

    service = IndexerService.build(settings, with_status=True)
    try:
        service.start()
    except KvIndexError as exc:
        service.stop()
        raise click.ClickException(str(exc)) from exc
    stop = stop_event()
    where = service.subscriber.bound_endpoint or "configured replicas"
    status = ""
    if service.status is not None:
        status = f", status on {service.status.server.url}"
    say(f"kvindex indexer ({settings.store} store) listening on {where}{status}")
    try:
        with StatusLog(lambda: fleet_status(service), stats_every):
            while not stop.wait(3600):
                pass
    finally:
        service.stop()
