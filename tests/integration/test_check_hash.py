"""``kvindex check-hash`` against an in-process replica simulator (real HTTP, real ZeroMQ)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
from click.testing import CliRunner

from kvindex.clients.cli.key_check import CheckSettings, run_check
from kvindex.clients.cli.main import main
from kvindex.clients.fake_vllm.replica import (
    ReplicaSim,
    ReplicaSimSettings,
)
from kvindex.indexer.ingest.wire import Encoding
from tests.support.redis_server import free_port

MODEL = "sim-model"


@pytest.fixture(params=["map", "array"])
def sim(request: pytest.FixtureRequest) -> Iterator[ReplicaSim]:
    """A replica serving MODEL and the LoRA adapters tenant-a and tenant-b, PUB and replay
    ROUTER bound on free loopback ports; stopped after the test."""
    encoding: Encoding = request.param
    settings = ReplicaSimSettings(
        id="r1",
        model=MODEL,
        events="tcp://127.0.0.1:*",
        replay="tcp://127.0.0.1:*",
        port=0,
        encoding=encoding,
        speed=1000.0,
        lora_names=("tenant-a", "tenant-b"),
    )
    with ReplicaSim(settings) as running:
        yield running


def settings_for(sim: ReplicaSim, **changes: object) -> CheckSettings:
    base = CheckSettings(
        url=sim.base_url,
        events=sim.events_endpoint,
        model=MODEL,
        replay=sim.replay_endpoint,
        timeout_s=3.0,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_plain_request_agrees(sim: ReplicaSim) -> None:
    report = run_check(settings_for(sim))
    assert report.ok, report.render()
    assert report.num_blocks == 4
    assert report.block_size == 16
    assert report.hash_forms == ["int"]
    assert report.encodings == [sim.settings.encoding]
    assert report.sources == ["live"]
    assert report.producers == ["vLLM"]
    assert report.render().startswith("check-hash OK: 4 blocks checked, block size 16")


def test_salted_lora_and_text_requests_agree(sim: ReplicaSim) -> None:
    assert run_check(settings_for(sim, cache_salt="salt-1")).ok
    assert run_check(settings_for(sim, lora_name="tenant-a", cache_salt="s")).ok
    text = run_check(settings_for(sim, mode="text", num_blocks=2))
    assert text.ok, text.render()
    assert text.num_blocks == 2


def test_wrong_expected_block_size_is_named(sim: ReplicaSim) -> None:
    report = run_check(settings_for(sim, block_size=32))
    assert not report.ok
    assert report.mismatches[0].message == "block size: events use 16, kvindex expects 32"
    assert any(m.check == "keys" for m in report.mismatches)


def test_lora_the_check_does_not_know_about_is_named(sim: ReplicaSim) -> None:
    # The adapter's name given as the model: the replica applies the LoRA, kvindex does not.
    report = run_check(settings_for(sim, model="tenant-a"))
    assert not report.ok
    extras = [m.message for m in report.mismatches if m.check == "extra_keys"]
    assert extras == [
        "extra keys differ on block 0 (and 3 more blocks): events ['tenant-a'], request []"
    ]
    assert any(m.check == "keys" for m in report.mismatches)


def test_different_lora_name_is_named(sim: ReplicaSim) -> None:
    report = run_check(settings_for(sim, lora_name="tenant-b", request_model="tenant-a"))
    assert not report.ok
    assert report.mismatches[0].check == "extra_keys"
    assert "events ['tenant-a'], request ['tenant-b']" in report.mismatches[0].message


def test_events_endpoint_without_publisher_times_out() -> None:
    settings = ReplicaSimSettings(
        model=MODEL, events="tcp://127.0.0.1:*", replay=None, port=0, speed=1000.0
    )
    with ReplicaSim(settings) as sim:
        silent = f"tcp://127.0.0.1:{free_port()}"
        report = run_check(settings_for(sim, events=silent, replay=None, timeout_s=1.0))
    assert not report.ok
    [mismatch] = report.mismatches
    assert mismatch.message == (
        f"no BlockStored events for the prompt within 1 s (no event at all from {silent}): "
        "is --kv-events-config enabled and is --enable-prefix-caching on?"
    )


def test_replay_recovers_when_live_events_are_missed(sim: ReplicaSim) -> None:
    # A topic filter matching nothing: live events never arrive, the replay has them all.
    report = run_check(settings_for(sim, topic="no-such-topic", timeout_s=1.0))
    assert report.ok, report.render()
    assert report.sources == ["replay"]
    assert report.encodings == ["unknown"]


def test_cli_pass_json_and_failure_exit_codes(sim: ReplicaSim) -> None:
    common = ["--url", sim.base_url, "--events", sim.events_endpoint, "--model", MODEL]
    runner = CliRunner()
    ok = runner.invoke(main, ["check-hash", *common, "--cache-salt", "x"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("check-hash OK: 4 blocks checked, block size 16, hash form int")
    as_json = runner.invoke(main, ["check-hash", *common, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)["ok"] is True
    bad = runner.invoke(main, ["check-hash", *common, "--block-size", "8"])
    assert bad.exit_code == 1
    assert bad.output.startswith("check-hash FAILED: block size: events use 16, kvindex expects 8")


def test_cli_unreachable_replica_is_an_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    events = f"tcp://127.0.0.1:{free_port()}"
    args = ["check-hash", "--url", url, "--events", events, "--model", MODEL, "--timeout", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "cannot reach the replica at" in result.output
