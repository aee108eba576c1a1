"""The route journal on Redis: one Stream every proxy appends to (``XADD … MAXLEN ~``: at
least ``maxlen``, a node more at most), read newest first. Calls block: run them off the loop.
A batch is appended by one script call per :data:`CHUNK` receipts: one command of their
arguments, not a command per receipt (which cost the proxy four times the CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.lua import lua_script

PAGE = 256  # entries read per call while looking for one id
CHUNK = 256  # receipts appended per script call (each call holds the server that long)
_ID, _RECEIPT = b"id", b"receipt"


class ReceiptStream:
    """A :class:`~kvindex.clients.proxy.journal.ReceiptSink` on a Redis Stream."""

    def __init__(self, client: RedisClient, key: str, maxlen: int) -> None:
        self._client = client
        self.key = key
        self._maxlen = maxlen
        self._append = client.register_script(lua_script(__name__, "receipt_append.lua"))

    def append(self, receipts: Sequence[tuple[str, bytes]]) -> None:
        """``receipts`` (request id, JSON) appended in order; raises the client's errors."""
        for start in range(0, len(receipts), CHUNK):
            args: list[Any] = [self._maxlen]
            for request_id, data in receipts[start : start + CHUNK]:
                args += (request_id.encode(), data)
            self._append(keys=[self.key], args=args)

    def find(self, request_id: str) -> bytes | None:
        """The newest receipt of ``request_id``, read from the newest back a page at a time."""
        wanted = request_id.encode()
        end = "+"
        while True:
            page: Any = self._client.xrevrange(self.key, max=end, min="-", count=PAGE)
            for _entry, fields in page:
                if fields.get(_ID) == wanted:
                    return bytes(fields[_RECEIPT])
            if len(page) < PAGE:
                return None
            end = "(" + _text(page[-1][0])

    def newest(self, count: int) -> list[bytes]:
        page: Any = self._client.xrevrange(self.key, max="+", min="-", count=count)
        return [bytes(fields[_RECEIPT]) for _entry, fields in page if _RECEIPT in fields]


def _text(entry: bytes | str) -> str:
    return entry.decode() if isinstance(entry, bytes) else entry
