"""The proxy's access log (logger ``kvindex.access``): one line per OpenAI-route request, in
the process's log format, naming its id, method, route, path, replica, status, time to first
byte, duration, matched fraction and retries; never a header or a body."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvindex.clients.proxy.metrics import NO_REPLICA

access_logger = logging.getLogger("kvindex.access")


@dataclass(slots=True)
class Exchange:
    """One request as far as the proxy knows it, filled in while it is answered."""

    request_id: str
    method: str
    route: str
    """The route template (the ``route`` label of the metrics)."""
    path: str
    started: float
    """``time.perf_counter()`` at its arrival."""
    replica: str = NO_REPLICA
    first_byte_s: float | None = None
    """Arrival to the replica's answer starting (None: no replica answered)."""
    matched_fraction: float | None = None
    retries: int | None = None
    """Replicas tried before the one that answered (None: none answered)."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Ours for its answer, whoever gives it (the replica's or the proxy's error)."""

    def answered_by(self, replica: str, position: int) -> None:
        """The replica whose head arrived, ``position`` (0-based) among those tried."""
        self.replica = replica
        self.retries = position
        self.first_byte_s = time.perf_counter() - self.started


def log_exchange(exchange: Exchange, status: int) -> None:
    """The access-log line of ``exchange``, ended now with ``status``."""
    duration_ms = round((time.perf_counter() - exchange.started) * 1000, 3)
    ttfb_ms = None if exchange.first_byte_s is None else round(exchange.first_byte_s * 1000, 3)
    matched = exchange.matched_fraction
    access_logger.info(
        "%s %s %d replica=%s ttfb_ms=%s duration_ms=%.1f matched=%s retries=%s id=%s",
        exchange.method,
        exchange.path,
        status,
        exchange.replica,
        "-" if ttfb_ms is None else f"{ttfb_ms:.1f}",
        duration_ms,
        "-" if matched is None else f"{matched:.3f}",
        "-" if exchange.retries is None else exchange.retries,
        exchange.request_id,
        extra={
            "request_id": exchange.request_id,
            "method": exchange.method,
            "route": exchange.route,
            "path": exchange.path,
            "replica": exchange.replica,
            "status": status,
            "ttfb_ms": ttfb_ms,
            "duration_ms": duration_ms,
            "matched_fraction": matched,
            "retries": exchange.retries,
        },
    )
