"""The route journal on Redis: one Stream every proxy appends to (``XADD … MAXLEN ~``: at
least ``maxlen``, a node more at most), read newest first. Calls block: run them off the loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvindex.indexer.redis.connection import RedisClient

PAGE = 256  # entries read per call while looking for one id
_ID, _RECEIPT = b"id", b"receipt"


class ReceiptStream:
    """A :class:`~kvindex.clients.proxy.journal.ReceiptSink` on a Redis Stream."""

    def __init__(self, client: RedisClient, key: str, maxlen: int) -> None:
        self._client = client
        self.key = key
        self._maxlen = maxlen

    def append(self, receipts: Sequence[tuple[str, bytes]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for request_id, data in receipts:
            fields = {_ID: request_id.encode(), _RECEIPT: data}
            pipe.xadd(self.key, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]
        pipe.execute()

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
