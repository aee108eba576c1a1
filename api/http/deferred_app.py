"""``kvindex serve``'s ASGI app: its lifespan runs the read path; the hot routes need no
FastAPI, which the first other request imports on a thread (the loop answering meanwhile)
and builds, once."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from kvindex.api.http.core import ApiCore


class DeferredApp:
    """The app of ``core``: its lifespan runs ``core.read_path``; FastAPI's routes on first use."""

    def __init__(self, core: ApiCore) -> None:
        self.core = core
        self._app: ASGIApp | None = None
        self._building = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self._app or await self._first_build()
        await app(scope, receive, send)

    @property
    def built(self) -> bool:
        """Whether a request has reached FastAPI's app (and so built it)."""
        return self._app is not None

    def build(self) -> ASGIApp:
        """FastAPI's app over ``core`` (without a lifespan: this one runs the read path)."""
        from kvindex.api.http.app import app_of  # noqa: PLC0415 (the import is the cost deferred)

        return app_of(self.core)

    async def _first_build(self) -> ASGIApp:
        async with self._building:
            if self._app is None:
                await asyncio.to_thread(_import_app)
                self._app = self.build()
        return self._app

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.core.read_path.start()
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            raise
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.core.read_path.stop()
        await send({"type": "lifespan.shutdown.complete"})


def _import_app() -> None:
    """Imports what :meth:`DeferredApp.build` needs (most of its cost)."""
    import kvindex.api.http.app  # noqa: F401, PLC0415
