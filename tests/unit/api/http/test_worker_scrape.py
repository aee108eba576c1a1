from __future__ import annotations

import asyncio
import stat
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.http.worker_scrape import (
    WorkerScrape,
    merged,
    private_directory,
    socket_path,
)


def _exposition(worker: int, requests: float) -> bytes:
    registry = CollectorRegistry()
    Counter("reqs", "Requests.", ["route"], registry=registry).labels("/a").inc(requests)
    Histogram("lat", "Latency.", registry=registry, buckets=(1.0,)).observe(0.5)
    Gauge("info", "Info.", ["worker", "pid"], registry=registry).labels(str(worker), "7").set(1)
    Gauge("up", "Up.", registry=registry).set(1)
    return generate_latest(registry)


def test_merged_expositions_parse_with_every_sample_labelled_by_its_worker() -> None:
    text = merged([(0, _exposition(0, 2)), (1, _exposition(1, 3))]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        s.labels["worker"]: s.value for s in families["reqs"].samples if s.name == "reqs_total"
    }
    assert requests == {"0": 2.0, "1": 3.0}
    assert {s.labels["worker"] for s in families["lat"].samples} == {"0", "1"}
    assert [s.labels for s in families["info"].samples] == [
        {"worker": "0", "pid": "7"},
        {"worker": "1", "pid": "7"},
    ]  # labelled already: kept, not labelled twice
    assert text.count("# TYPE up gauge") == 1


def test_one_worker_scrape_answers_every_workers_series(tmp_path: Path) -> None:
    async def main() -> str:
        failures: list[int] = []

        def scrape(worker: int, requests: float) -> WorkerScrape:
            async def own() -> bytes:
                return _exposition(worker, requests)

            return WorkerScrape(tmp_path, worker, 3, own, on_failure=lambda: failures.append(1))

        first, second = scrape(0, 2), scrape(1, 5)  # worker 2 never started
        await first.start()
        await second.start()
        try:
            text = (await first.render()).decode()
        finally:
            await first.stop()
            await second.stop()
        assert failures == [1]
        return text

    text = asyncio.run(main())
    assert 'reqs_total{worker="0",route="/a"} 2.0' in text
    assert 'reqs_total{worker="1",route="/a"} 5.0' in text
    assert 'worker="2"' not in text


def test_a_sibling_that_never_answers_is_left_out_in_time(tmp_path: Path) -> None:
    async def main() -> tuple[bytes, float, int]:
        async def hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await asyncio.sleep(30)
            finally:
                writer.close()

        hung = await asyncio.start_unix_server(hang, socket_path(tmp_path, 1))
        failures: list[int] = []

        async def own() -> bytes:
            return _exposition(0, 1)

        scrape = WorkerScrape(
            tmp_path, 0, 2, own, on_failure=lambda: failures.append(1), timeout_s=0.2
        )
        started = asyncio.get_running_loop().time()
        text = await scrape.render()
        hung.close()
        return text, asyncio.get_running_loop().time() - started, len(failures)

    text, took_s, failures = asyncio.run(main())
    assert b'reqs_total{worker="0",route="/a"} 1.0' in text
    assert took_s < 2 and failures == 1


def test_the_sockets_directory_is_this_users_alone(tmp_path: Path) -> None:
    path = private_directory(str(tmp_path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
