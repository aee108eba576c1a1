"""``kvindex serve``'s ASGI app: its lifespan runs the read path; the hot routes need no
FastAPI, whose modules a thread imports once started and whose app the first other request
builds, once, on the loop."""

from __future__ import annotations

import threading

from starlette.types import ASGIApp, Receive, Scope, Send

from kvindex.api.http.core import ApiCore


class DeferredApp:
    """The app of ``core``: its lifespan runs ``core.read_path``; FastAPI's routes on first use."""

    def __init__(self, core: ApiCore) -> None:
        self.core = core
        self._app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self._app
        if app is None:
            app = self._app = self.build()
        await app(scope, receive, send)

    @property
    def built(self) -> bool:
        """Whether a request has reached FastAPI's app (and so built it)."""
        return self._app is not None

    def build(self) -> ASGIApp:
        """FastAPI's app over ``core`` (without a lifespan: this one runs the read path)."""
        from kvindex.api.http.app import app_of  # noqa: PLC0415 (the import is the cost deferred)

        return app_of(self.core)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.core.read_path.start()
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            raise
        await send({"type": "lifespan.startup.complete"})
        threading.Thread(target=_import_app, name="kvindex-app-import", daemon=True).start()
        await receive()  # lifespan.shutdown
        await self.core.read_path.stop()
        await send({"type": "lifespan.shutdown.complete"})


def _import_app() -> None:
    """Imports what :meth:`DeferredApp.build` needs (Python's import lock makes a build that
    starts meanwhile wait for this import rather than run a second one)."""
    import kvindex.api.http.app  # noqa: F401, PLC0415
