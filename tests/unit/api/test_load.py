"""Load values, vLLM ``/metrics`` parsing, store specifics and the scraper (no services)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator, Sequence

import fakeredis
import httpx
import msgspec
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex.api.load import (
    GPU_USAGE_OLD,
    KV_USAGE,
    RUNNING,
    WAITING,
    Load,
    LoadError,
    MemoryLoadStore,
    MetricsScraper,
    RedisLoadStore,
    ScrapeStats,
    ScrapeTarget,
    is_newer_or_same,
    metrics_url,
    parse_vllm_metrics,
)
from kvindex.indexer.errors import KvIndexError
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis_schema import Schema
from tests.support.redis_server import free_port

NOW = 1_700_000_000.5

# What vLLM V1 serves with data parallelism (2 engines), trimmed: HELP/TYPE lines, gauges
# per engine, counters, histograms and the Python process metrics of prometheus_client.
VLLM_DP2 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.1e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.87
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 81920.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 40960.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 7.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0"} 1.0
"""

# An older vLLM (V0, before 0.10): no engine label, GPU cache usage under its old name.
VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.6
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.9
"""


def a_load(**changes: object) -> Load:
    fields: dict[str, object] = {
        "running": 1.0,
        "waiting": 2.0,
        "kv_usage": 0.5,
        "ts": NOW,
        "source": "push",
    }
    fields.update(changes)
    return Load(**fields)  # type: ignore[arg-type]


# --- Load ---------------------------------------------------------------------------------


def test_load_error_is_a_kvindex_error() -> None:
    assert issubclass(LoadError, KvIndexError)


@pytest.mark.parametrize("usage", [0.0, 1.0])
def test_usage_bounds_are_inclusive(usage: float) -> None:
    assert a_load(kv_usage=usage).kv_usage == usage


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("running", -1.0),
        ("waiting", -0.5),
        ("ts", -1.0),
        ("kv_usage", -0.01),
        ("kv_usage", 1.01),
        ("running", math.nan),
        ("waiting", math.inf),
        ("kv_usage", math.nan),
        ("ts", math.inf),
        ("running", "3"),
        ("waiting", True),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(LoadError, match=rf"^{field} must be"):
        a_load(**{field: value})


def test_validated_returns_the_load_itself() -> None:
    load = a_load()
    assert load.validated() is load


def test_unknown_source_is_rejected() -> None:
    with pytest.raises(LoadError, match="source must be one of"):
        a_load(source="guess")


def test_decoding_checks_too() -> None:
    raw = b'{"running":1,"waiting":0,"kv_usage":1.5,"ts":1.0,"source":"push"}'
    with pytest.raises(LoadError, match="kv_usage"):
        msgspec.json.decode(raw, type=Load)


def test_load_is_frozen() -> None:
    with pytest.raises(AttributeError):
        a_load().running = 2.0  # type: ignore[misc]


def test_age() -> None:
    assert a_load(ts=100.0).age_s(now=112.5) == 12.5
    assert a_load(ts=100.0).age_s(now=90.0) == 0.0


def test_newer_or_same_rule() -> None:
    assert is_newer_or_same(a_load(ts=1.0), None)
    assert is_newer_or_same(a_load(ts=2.0), a_load(ts=1.0))
    assert is_newer_or_same(a_load(ts=1.0), a_load(ts=1.0))
    assert not is_newer_or_same(a_load(ts=1.0), a_load(ts=2.0))


def test_load_key_name() -> None:
    assert Schema("p").load == "p:v1:load"
    assert Schema().load == "kvindex:v1:load"


# --- parse_vllm_metrics ---------------------------------------------------------------------


def test_parses_data_parallel_engines() -> None:
    # Counts are summed over engines; usage is the busiest engine's.
    assert parse_vllm_metrics(VLLM_DP2, now=NOW) == Load(
        running=8.0, waiting=1.0, kv_usage=0.87, ts=NOW, source="scrape"
    )


def test_parses_the_old_usage_name() -> None:
    assert parse_vllm_metrics(VLLM_OLD, now=NOW) == Load(
        running=2.0, waiting=4.0, kv_usage=0.6, ts=NOW, source="scrape"
    )


def test_new_usage_name_wins_over_the_old_one() -> None:
    text = f'{KV_USAGE}{{model_name="m"}} 0.3\n{GPU_USAGE_OLD}{{model_name="m"}} 0.9\n'
    assert parse_vllm_metrics(text, now=NOW).kv_usage == 0.3


def test_total_suffix_variants() -> None:
    text = (
        f"# TYPE {RUNNING}_total counter\n{RUNNING}_total 6\n"
        f"{WAITING}_total 2\n{KV_USAGE}_total 0.5\n"
    )
    assert parse_vllm_metrics(text, now=NOW) == Load(6.0, 2.0, 0.5, NOW, "scrape")


def test_exact_name_wins_over_total_variant() -> None:
    text = f"{RUNNING} 3\n{RUNNING}_total 100\n"
    assert parse_vllm_metrics(text, now=NOW).running == 3.0


def test_absent_metrics_read_as_zero() -> None:
    assert parse_vllm_metrics(f"{RUNNING} 2\n", now=NOW) == Load(2.0, 0.0, 0.0, NOW, "scrape")


def test_no_vllm_metrics_is_an_error() -> None:
    text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"
    with pytest.raises(LoadError, match="no vLLM load metrics"):
        parse_vllm_metrics(text, now=NOW)


def test_empty_text_is_an_error() -> None:
    with pytest.raises(LoadError, match="no vLLM load metrics"):
        parse_vllm_metrics("", now=NOW)


def test_unparseable_text_is_an_error() -> None:
    with pytest.raises(LoadError, match="unparseable"):
        parse_vllm_metrics(f"{RUNNING}{{engine=0 three\n", now=NOW)


def test_invalid_value_is_an_error_naming_the_field() -> None:
    with pytest.raises(LoadError, match="kv_usage"):
        parse_vllm_metrics(f"{RUNNING} 1\n{KV_USAGE} 1.5\n", now=NOW)
    with pytest.raises(LoadError, match="running"):
        parse_vllm_metrics(f"{RUNNING} NaN\n", now=NOW)


TWO_MODELS = (
    f'{RUNNING}{{engine="0",model_name="a"}} 1\n'
    f'{RUNNING}{{engine="1",model_name="a"}} 2\n'
    f'{RUNNING}{{engine="0",model_name="b"}} 40\n'
    f'{KV_USAGE}{{engine="0",model_name="a"}} 0.2\n'
    f'{KV_USAGE}{{engine="0",model_name="b"}} 0.9\n'
    f"{WAITING} 7\n"
)


def test_model_filter_counts_only_that_model() -> None:
    assert parse_vllm_metrics(TWO_MODELS, now=NOW, model="a") == Load(3.0, 0.0, 0.2, NOW, "scrape")
    assert parse_vllm_metrics(TWO_MODELS, now=NOW, model="b") == Load(40.0, 0.0, 0.9, NOW, "scrape")


def test_no_filter_counts_every_sample() -> None:
    assert parse_vllm_metrics(TWO_MODELS, now=NOW) == Load(43.0, 7.0, 0.9, NOW, "scrape")


def test_model_filter_without_a_match_is_an_error_listing_the_models() -> None:
    with pytest.raises(LoadError, match=r"model_name='c'.*\['a', 'b'\]"):
        parse_vllm_metrics(TWO_MODELS, now=NOW, model="c")


def test_model_filter_on_a_real_name() -> None:
    load = parse_vllm_metrics(VLLM_OLD, now=NOW, model="meta-llama/Llama-3.1-8B-Instruct")
    assert (load.running, load.waiting) == (2.0, 4.0)


# --- stores: backend specifics --------------------------------------------------------------


def test_memory_store_is_thread_safe_and_keeps_the_newest() -> None:
    store = MemoryLoadStore()

    def writer(offset: int) -> None:
        for i in range(500):
            store.put("r1", a_load(ts=float(i * 8 + offset)))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get_many(["r1"])["r1"].ts == 499 * 8 + 7


def test_redis_store_layout_is_one_hash_of_json() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(running=3.0))
    assert client.keys("*") == [b"p:v1:load"]
    raw = client.hget("p:v1:load", "r1")
    assert isinstance(raw, bytes)
    assert json.loads(raw) == {
        "running": 3.0,
        "waiting": 2.0,
        "kv_usage": 0.5,
        "ts": NOW,
        "source": "push",
    }
    store.close()


def test_two_redis_stores_on_one_server_agree() -> None:
    server = fakeredis.FakeServer()
    first = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    second = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    first.put("r1", a_load(ts=2.0, source="push"))
    second.put("r1", a_load(ts=1.0, source="scrape"))
    assert first.get_many(["r1"]) == second.get_many(["r1"]) == {"r1": a_load(ts=2.0)}
    second.remove("r1")
    assert first.get_many(["r1"]) == {}
    first.close()
    second.close()


def test_prefixes_do_not_share_load() -> None:
    client = fakeredis.FakeRedis()
    RedisLoadStore(client, Schema("a")).put("r1", a_load())
    assert RedisLoadStore(client, Schema("b")).get_many(["r1"]) == {}


@pytest.mark.parametrize("junk", [b"not json", b'{"running": -1}', b"[1, 2]"])
def test_an_undecodable_stored_value_reads_as_absent_and_is_replaced(junk: bytes) -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    client.hset("p:v1:load", "r1", junk)
    assert store.get_many(["r1"]) == {}
    store.put("r1", a_load(ts=1.0))
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.0)}


def test_answer_counts_are_a_field_of_the_load_hash() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    store.get_counted(["r1"], ["r1"] * 2)
    assert client.keys("*") == [b"p:v1:load"]
    assert client.hget("p:v1:load", "r1/answers") == b"2"
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.5)}
    store.remove("r1")
    assert client.keys("*") == []


@pytest.mark.parametrize("junk", [b"", b"garbage", b"-3"])
def test_an_unreadable_answer_count_reads_as_0_and_a_new_load_resets_it(junk: bytes) -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    client.hset("p:v1:load", "r1/answers", junk)
    assert store.get_counted(["r1"])["r1"].routed == 0
    assert store.get_counted(["r1"], ["r1"])["r1"].routed == 0  # no crash, still 0
    store.put("r1", a_load(ts=2.0))
    assert store.get_counted(["r1"], ["r1"])["r1"].routed == 1


@pytest.fixture
def dead_redis() -> Iterator[redis.Redis]:
    """A client of a loopback port nothing listens on, without retries."""
    client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


def test_redis_down_is_index_unavailable(dead_redis: redis.Redis) -> None:
    store = RedisLoadStore(dead_redis, Schema("p"))
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.put("r1", a_load())
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.get_many(["r1"])
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.remove("r1")
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.get_counted(["r1"], ["r1"])


# --- MetricsScraper over a mock transport (real HTTP: tests/integration) --------------------


def metrics_text(running: float, model: str = "m") -> str:
    labels = f'{{engine="0",model_name="{model}"}}'
    return f"{RUNNING}{labels} {running}\n{KV_USAGE}{labels} 0.5\n"


def handler(request: httpx.Request) -> httpx.Response:
    """``http://<host>/metrics``: host ``ok-<n>`` serves ``n`` running, ``err`` a 503."""
    host = request.url.host
    if request.url.path != "/metrics":
        return httpx.Response(404)
    if host.startswith("ok-"):
        return httpx.Response(200, text=metrics_text(float(host.removeprefix("ok-"))))
    return httpx.Response(503, text="busy")


class FailingStore(MemoryLoadStore):
    def put(self, replica: str, load: Load) -> None:
        raise IndexUnavailableError("redis: down")


def scrape_once(store: MemoryLoadStore, targets: Sequence[ScrapeTarget]) -> MetricsScraper:
    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(store, client, lambda: targets, clock=lambda: NOW)
            await scraper.scrape_once()
            return scraper

    return asyncio.run(main())


def test_scrape_stores_loads_and_counts() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", "http://ok-3/", "m"), ("r2", "http://err", None)])
    assert store.get_many(["r1", "r2"]) == {"r1": Load(3.0, 0.0, 0.5, NOW, "scrape")}
    assert scraper.stats() == {
        "r1": ScrapeStats(num_scrapes=1, last_success_ts=NOW),
        "r2": ScrapeStats(
            num_scrapes=1, num_failures=1, last_error="GET http://err/metrics: HTTP 503"
        ),
    }


def test_api_processes_sharing_redis_scrape_each_replica_once_a_round() -> None:
    server = fakeredis.FakeServer()
    stores = [RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p")) for _ in range(2)]
    targets = [("r1", "http://ok-1/", "m"), ("r2", "http://ok-2/", "m")]
    fetched: list[str] = []

    def counting(request: httpx.Request) -> httpx.Response:
        fetched.append(request.url.host)
        return handler(request)

    async def main() -> list[MetricsScraper]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(counting)) as client:
            scrapers = [
                MetricsScraper(store, client, lambda: targets, interval_s=60.0, clock=lambda: NOW)
                for store in stores
            ]
            for scraper in scrapers:
                await scraper.scrape_once()
            return scrapers

    first, second = asyncio.run(main())
    assert sorted(fetched) == ["ok-1", "ok-2"]  # once each, by the first process
    assert stores[1].get_many(["r1", "r2"]) == {
        "r1": Load(1.0, 0.0, 0.5, NOW, "scrape"),
        "r2": Load(2.0, 0.0, 0.5, NOW, "scrape"),
    }
    assert {r: s.num_scrapes for r, s in first.stats().items()} == {"r1": 1, "r2": 1}
    assert second.stats() == {
        "r1": ScrapeStats(num_left_to_peers=1),
        "r2": ScrapeStats(num_left_to_peers=1),
    }


class UnclaimableStore(MemoryLoadStore):
    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        raise IndexUnavailableError("redis: down")


def test_claims_that_cannot_be_made_leave_every_replica_to_scrape() -> None:
    store = UnclaimableStore()
    scraper = scrape_once(store, [("r1", "http://ok-3/", "m")])
    assert store.get_many(["r1"]) == {"r1": Load(3.0, 0.0, 0.5, NOW, "scrape")}
    assert scraper.stats() == {"r1": ScrapeStats(num_scrapes=1, last_success_ts=NOW)}


def test_replicas_without_url_are_not_scraped() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", None, "m"), ("r2", "", "m")])
    assert scraper.stats() == {}
    assert store.get_many(["r1", "r2"]) == {}


def test_model_filter_is_applied() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", "http://ok-3", "other")])
    assert store.get_many(["r1"]) == {}
    assert "model_name='other'" in (scraper.stats()["r1"].last_error or "")


def test_store_errors_are_counted() -> None:
    scraper = scrape_once(FailingStore(), [("r1", "http://ok-3", None)])
    assert scraper.stats()["r1"] == ScrapeStats(
        num_scrapes=1, num_failures=1, last_error="IndexUnavailableError: redis: down"
    )


def test_targets_are_read_every_round_and_stats_follow_them() -> None:
    store = MemoryLoadStore()
    rounds: list[list[ScrapeTarget]] = [
        [("r1", "http://ok-1", None), ("r2", "http://err", None)],
        [("r1", "http://ok-4", None), ("r3", "http://ok-2", None)],
    ]
    clock = iter([10.0, 20.0, 21.0])

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(
                store, client, lambda: rounds.pop(0), clock=lambda: next(clock)
            )
            await scraper.scrape_once()
            await scraper.scrape_once()
            return scraper

    scraper = asyncio.run(main())
    assert set(scraper.stats()) == {"r1", "r3"}
    assert scraper.stats()["r1"].num_scrapes == 2
    assert {r: load.running for r, load in store.get_many(["r1", "r2", "r3"]).items()} == {
        "r1": 4.0,
        "r3": 2.0,
    }


def test_a_success_clears_last_error_and_keeps_counts() -> None:
    store = MemoryLoadStore()
    rounds: list[list[ScrapeTarget]] = [[("r1", "http://err", None)], [("r1", "http://ok-1", None)]]

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(store, client, lambda: rounds.pop(0), clock=lambda: NOW)
            await scraper.scrape_once()
            await scraper.scrape_once()
            return scraper

    assert asyncio.run(main()).stats()["r1"] == ScrapeStats(2, 1, None, NOW)


def test_failing_targets_callable_skips_the_round() -> None:
    def targets() -> list[ScrapeTarget]:
        raise RuntimeError("registry unavailable")

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(MemoryLoadStore(), client, targets)
            await scraper.scrape_once()
            return scraper

    assert asyncio.run(main()).stats() == {}


def test_start_twice_is_an_error_and_stop_is_idempotent() -> None:
    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(
                MemoryLoadStore(), client, list, interval_s=0.01, timeout_s=0.01
            )
            await scraper.stop()
            await scraper.start()
            with pytest.raises(RuntimeError, match="already running"):
                await scraper.start()
            await scraper.stop()
            await scraper.stop()
            assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


@pytest.mark.parametrize(
    ("interval_s", "timeout_s"), [(0.0, 1.0), (1.0, 0.0), (-1.0, -2.0), (1.0, math.nan)]
)
def test_interval_and_timeout_must_be_positive(interval_s: float, timeout_s: float) -> None:
    client = httpx.AsyncClient()
    with pytest.raises(ValueError, match="must be > 0"):
        MetricsScraper(MemoryLoadStore(), client, list, interval_s=interval_s, timeout_s=timeout_s)
    asyncio.run(client.aclose())


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://h:8000", "http://h:8000/metrics"),
        ("http://h:8000/", "http://h:8000/metrics"),
        ("http://h/vllm/", "http://h/vllm/metrics"),
    ],
)
def test_metrics_url(base: str, url: str) -> None:
    assert metrics_url(base) == url
