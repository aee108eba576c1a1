"""The journal's Redis Stream on fakeredis: batches in one pipeline, trimmed, an id found
across pages newest first, the newest read back in order."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from kvindex.clients.proxy import receipt_stream
from kvindex.clients.proxy.receipt_stream import ReceiptStream
from kvindex.indexer.redis.schema import Schema

KEY = Schema("kvindex").receipts


def _stream(maxlen: int = 1000) -> tuple[ReceiptStream, fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return ReceiptStream(client, KEY, maxlen), client


def test_a_batch_is_appended_in_order_and_read_back_newest_first() -> None:
    stream, client = _stream()
    stream.append([("a", b'{"id":"a"}'), ("b", b'{"id":"b"}')])
    stream.append([("c", b'{"id":"c"}')])
    assert client.xlen(KEY) == 3
    assert stream.newest(2) == [b'{"id":"c"}', b'{"id":"b"}']


def test_the_stream_is_trimmed_to_about_its_maxlen() -> None:
    stream, client = _stream(maxlen=10)
    for number in range(50):
        stream.append([(f"r{number}", b"{}")])
    assert 10 <= client.xlen(KEY) <= 10 + 100  # MAXLEN ~: at most a node more


def test_an_id_is_found_across_pages_and_its_newest_receipt_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(receipt_stream, "PAGE", 3)
    stream, _ = _stream()
    stream.append([("old", b"first"), *((f"x{n}", b"{}") for n in range(10)), ("old", b"last")])
    stream.append([(f"y{n}", b"{}") for n in range(7)])
    assert stream.find("old") == b"last"
    assert stream.find("x0") == b"{}"
    assert stream.find("never") is None
    assert stream.find("\u00e9\x00 odd") is None  # any text is only compared


def test_a_batch_longer_than_a_chunk_is_appended_whole_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(receipt_stream, "CHUNK", 3)
    stream, client = _stream()
    stream.append([(f"r{n}", f'{{"n":{n}}}'.encode()) for n in range(8)])
    entries: Any = client.xrange(KEY)
    assert [fields[b"id"] for _, fields in entries] == [f"r{n}".encode() for n in range(8)]
    assert stream.newest(1) == [b'{"n":7}']
    stream.append([])  # nothing to send: no error
    assert client.xlen(KEY) == 8
