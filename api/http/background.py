"""An ASGI app served by uvicorn in a background thread (demo, replica-sim, tests)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Literal

import uvicorn

from kvindex.indexer.domain.errors import KvIndexError


class ServerStartError(KvIndexError):
    """The HTTP server did not start (port taken, app failing at start-up, timeout)."""


class BackgroundServer:
    """One uvicorn server in a daemon thread; a context manager."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lifespan: Literal["auto", "on", "off"] = "auto",
        name: str = "kvindex-http",
        http: type[asyncio.Protocol] | Literal["h11"] = "h11",
    ) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan=lifespan,
            log_level="warning",
            access_log=False,
            ws="none",
            http=http,
        )
        self.host = host
        self.port = port
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
