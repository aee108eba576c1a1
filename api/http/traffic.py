"""Every HTTP request counted, timed and (optionally) logged, by route template."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvindex.api.http.metrics import UNMATCHED_ROUTE, ApiMetrics
from kvindex.api.http.tally import Timings

access_logger = logging.getLogger("kvindex.access")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_OTHER_METHOD = "other"


class TrafficObserver:
    """Counts and times every HTTP request once answered; logs it if ``access_log``."""

    def __init__(self, app: ASGIApp, *, metrics: ApiMetrics, access_log: bool) -> None:
        self.app = app
        self._metrics = metrics
        self._access_log = access_log
        self._timings: dict[tuple[str, str, int], Timings] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            self.observe(scope, status, time.perf_counter() - started)

    def observe(self, scope: Scope, status: int, elapsed_s: float) -> None:
        """Count and time one answered request, by ``scope["route"]``'s template."""
        # The router stores the matched route in the scope (FastAPI and Starlette routes
        # both have the template as ``path``).
        route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
        method = scope["method"] if scope["method"] in _METHODS else _OTHER_METHOD
        key = (route, method, status)
        timings = self._timings.get(key)
        if timings is None:
            metrics = self._metrics
            counter = metrics.http_requests.labels(route, method, str(status))
            latency = metrics.http_latency.labels(route)
            timings = self._timings[key] = metrics.tally.timings(latency, counter)
        timings.observe(elapsed_s)
        if self._access_log:
            _log_access(scope, route, status, elapsed_s)


def _log_access(scope: Scope, route: str, status: int, elapsed_s: float) -> None:
    """One line per request: method, path (no query), status, milliseconds."""
    client = scope.get("client")
    duration_ms = round(elapsed_s * 1000, 3)
    access_logger.info(
        "%s %s %d %.1f ms",
        scope["method"],
        scope["path"],
        status,
        duration_ms,
        extra={
            "method": scope["method"],
            "path": scope["path"],
            "route": route,
            "status": status,
            "duration_ms": duration_ms,
            "client": f"{client[0]}:{client[1]}" if client else None,
        },
    )
