"""One ``/metrics`` scrape for all of ``--workers N``: each worker serves its own series on a
Unix socket in a directory only its user may enter; the worker a scrape reaches asks its
siblings and answers every worker's series, each labelled ``worker``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

logger = logging.getLogger("kvindex.workers")
TIMEOUT_S = 1.0
"""A sibling that has not answered in this long is left out of the scrape."""


def socket_path(directory: Path, worker: int) -> Path:
    return directory / f"worker-{worker}.sock"


class WorkerScrape:
    """Worker ``worker`` of ``num_workers``: serves ``own()`` to its siblings, and
    :meth:`render` gathers theirs; ``on_failure`` is called once per sibling left out."""

    def __init__(
        self,
        directory: Path,
        worker: int,
        num_workers: int,
        own: Callable[[], Awaitable[bytes]],
        *,
        on_failure: Callable[[], None],
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.directory = directory
        self.worker = worker
        self.num_workers = num_workers
        self._own = own
        self._on_failure = on_failure
        self._timeout_s = timeout_s
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        path = socket_path(self.directory, self.worker)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # the socket of this worker's previous life
        self._server = await asyncio.start_unix_server(self._answer, path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def render(self) -> bytes:
        """Every worker's series (this one's and each sibling's that answered in time)."""
        siblings = [w for w in range(self.num_workers) if w != self.worker]
        asks = asyncio.gather(*(self._ask(w) for w in siblings))
        own, theirs = await asyncio.gather(self._own(), asks)
        texts = [(self.worker, own)]
        texts += [(w, text) for w, text in zip(siblings, theirs, strict=True) if text is not None]
        return merged(sorted(texts))

    async def _answer(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(await self._own())
            await writer.drain()
        except Exception as exc:  # a sibling that went away mid-answer, or a failed render
            logger.warning("worker %d: series not sent to a sibling: %r", self.worker, exc)
        finally:
            writer.close()

    async def _ask(self, worker: int) -> bytes | None:
        path = socket_path(self.directory, worker)
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await asyncio.open_unix_connection(path)
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            logger.warning(
                "worker %d: worker %d's series left out of this scrape: %r",
                self.worker,
                worker,
                exc,
            )
            self._on_failure()
            return None


def merged(texts: Sequence[tuple[int, bytes]]) -> bytes:
    """Prometheus text expositions of several workers as one: a family's samples together
    under its ``# HELP`` and ``# TYPE`` (once), each sample labelled with its worker (one
    labelled ``worker`` already is left as it is)."""
    families: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
    for worker, text in texts:
        label = b'worker="%d"' % worker
        samples: list[bytes] | None = None
        for line in text.splitlines():
            if line.startswith(b"# "):
                words = line.split(b" ", 3)
                heads, samples = families.setdefault(words[2] if len(words) > 2 else b"", ([], []))
                if line not in heads:
                    heads.append(line)
            elif line and samples is not None:
                samples.append(_labelled(line, label))
    lines = [line for heads, samples in families.values() for line in (*heads, *samples)]
    return b"".join(line + b"\n" for line in lines)


def _labelled(sample: bytes, label: bytes) -> bytes:
    brace, space = sample.find(b"{"), sample.find(b" ")
    if brace < 0 or 0 <= space < brace:  # no labels
        return sample[:space] + b"{" + label + b"}" + sample[space:]
    labels = sample[brace : sample.rfind(b"}")]
    if b'{worker="' in labels or b',worker="' in labels:
        return sample
    close = b"" if sample[brace + 1 : brace + 2] == b"}" else b","
    return sample[: brace + 1] + label + close + sample[brace + 1 :]


def private_directory(parent: str | None = None) -> Path:
    """A new directory for the workers' sockets, entered by this user alone."""
    path = Path(tempfile.mkdtemp(prefix="kvindex-workers-", dir=parent))
    os.chmod(path, 0o700)
    return path
