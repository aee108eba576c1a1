"""The passive hang detection: replicas on loopback ports that answer or never do, behind
the forwarder's own transport; the health probe is a function the test decides."""

from __future__ import annotations

import asyncio

import pytest

from kvindex.clients.proxy.connections import RawAnswer
from kvindex.clients.proxy.forwarding import Forwarder, UpstreamFailedError
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Upstream
from tests.unit.clients.proxy.test_connections import OK, Replica, _answer, _run

SILENCE_S = 0.2


async def _hangs(_: bytes, reader: asyncio.StreamReader, __: asyncio.StreamWriter) -> None:
    await reader.read()  # the kernel took the request; nothing answers


class Probes:
    """The health probe: every call kept; ``hung`` says which replicas fail it."""

    def __init__(self, *hung: str) -> None:
        self.hung = set(hung)
        self.calls: list[tuple[str, float]] = []

    async def confirm(self, replica: str, silent_s: float) -> bool:
        self.calls.append((replica, silent_s))
        return replica in self.hung


def _forwarder(probes: Probes) -> Forwarder:
    settings = ProxySettings(hang_silence_s=SILENCE_S, retry_backoff_s=0)
    return Forwarder(settings, ProxyMetrics(), confirm_hang=probes.confirm)


def test_a_request_waiting_on_a_hung_replica_goes_elsewhere_within_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probes = Probes("hung")

    async def test() -> None:
        async with Replica(_hangs) as hung, Replica(_answer(OK)) as good:
            forwarder = _forwarder(probes)
            upstreams = (Upstream("hung", hung.url), Upstream("good", good.url))
            loop = asyncio.get_running_loop()
            started = loop.time()
            opened = await forwarder.open("/v1/x", b"{}", [], upstreams, forwarder.deadline())
            took = loop.time() - started
            assert isinstance(opened.response, RawAnswer)  # over ReplicaTransport
            body = b"".join([chunk async for chunk in opened.response.stream])
            assert opened.upstream.replica == "good" and body == b"hello"
            await opened.response.aclose()
            assert SILENCE_S <= took <= 1.5 * SILENCE_S + 0.2  # the probe answers at once here
            await asyncio.wait_for(hung.client_closed.wait(), 5)  # its attempt cancelled
            await forwarder.close()

    _run(test)
    assert [replica for replica, _ in probes.calls] == ["hung"]
    assert probes.calls[0][1] >= SILENCE_S
    assert "replica hung: 1 requests waiting with no byte sent elsewhere" in caplog.text


def test_a_silent_replica_passing_its_probe_keeps_its_requests_and_is_not_probed_again() -> None:
    probes = Probes()  # every probe passes: a long generation, not a hang

    async def test() -> None:
        async with Replica(_hangs) as slow:
            forwarder = _forwarder(probes)
            upstreams = (Upstream("slow", slow.url),)
            opening = forwarder.open("/v1/x", b"{}", [], upstreams, forwarder.deadline())
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.6 * SILENCE_S):
                    await opening
            assert len(probes.calls) == 1  # probed once in that time, the request kept
            await forwarder.close()

    _run(test)


def test_abandoning_a_replica_ends_only_its_waits_with_no_byte() -> None:
    async def test() -> None:
        async with Replica(_hangs) as hung, Replica(_hangs) as other:
            forwarder = _forwarder(Probes())
            deadline = forwarder.deadline()
            targets = [Upstream("hung", hung.url), Upstream("hung", hung.url)]
            targets.append(Upstream("other", other.url))
            opening = [
                asyncio.ensure_future(forwarder.open("/v1/x", b"{}", [], (t,), deadline))
                for t in targets
            ]
            while len(hung.requests) < 2 or not other.requests:
                await asyncio.sleep(0.01)
            assert forwarder.abandon("hung", "ejected") == 2
            for waiting in opening[:2]:
                with pytest.raises(UpstreamFailedError, match="hung: abandoned"):
                    await waiting  # no other replica to try: the 502 path
            assert not opening[2].done()
            opening[2].cancel()
            await forwarder.close()

    _run(test)
