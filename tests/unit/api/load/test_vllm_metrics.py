"""kvindex.api.load.vllm_metrics: parsing vLLM's ``/metrics`` exposition, its URL."""

from __future__ import annotations

import pytest

from kvindex.api.load.model import Load, LoadError
from kvindex.api.load.vllm_metrics import (
    GPU_USAGE_OLD,
    KV_USAGE,
    RUNNING,
    WAITING,
    metrics_url,
    parse_vllm_metrics,
)
from tests.unit.api.load.samples import NOW

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
