"""kvindex answers Dynamo's standalone-indexer API as Dynamo's own indexer (ai-dynamo-runtime
1.6.1) does, on the same event streams (``tests/support/dynamo_parity.py`` runs both): with the
default compiled ingest path, and with ``api.dynamo_dump`` (the journal, ``GET /dump``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.dynamo_venv import UnavailableError, dynamo_python, private_network
from tests.support.paths import ROOT

PHASES = ("stores_and_removals", "after_clear", "after_unregister")


def _run(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> dict[str, Any]:
    try:
        python, prefix = dynamo_python(), private_network()
    except UnavailableError as exc:
        pytest.skip(f"Dynamo's indexer cannot run here: {exc}")
    out: Path = tmp_path_factory.mktemp("dynamo-parity")
    command = [
        *prefix,
        sys.executable,
        "-m",
        "tests.support.dynamo_parity",
        "--dynamo-python",
        str(python),
        "--out",
        str(out),
        "--peers",
        *flags,
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module", params=["compiled", "journal"])
def parity(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    result = _run(tmp_path_factory, *(["--dump"] if request.param == "journal" else []))
    result["mode"] = request.param
    return result


@pytest.mark.timeout(900)  # the first run creates the venv (about a minute)
def test_query_answers_agree_on_every_prompt(parity: dict[str, Any]) -> None:
    for phase in PHASES:
        found = parity[phase]
        assert found["agree"] == found["prompts"], (phase, found["differ"])
        assert found["nonempty"] >= found["prompts"] * 0.8, phase  # the prompts do match


@pytest.mark.timeout(900)
def test_workers_agree_before_and_after_unregistering(parity: dict[str, Any]) -> None:
    assert parity["workers"]["agree"], parity["workers"]
    assert parity["workers_after_unregister"]["agree"], parity["workers_after_unregister"]
    assert [status for status, _ in parity["unregister"]] == [200, 200]
    assert {w["instance_id"] for w in parity["workers_after_unregister"]["kvindex"]} == {1, 2}


@pytest.mark.timeout(900)
def test_a_dynamo_peer_recovers_from_kvindex_only_with_the_dump(parity: dict[str, Any]) -> None:
    """``--peers`` kvindex: with ``api.dynamo_dump`` Dynamo recovers kvindex's state and answers
    every prompt as kvindex does; without it, ``GET /dump`` is a 404 and Dynamo starts empty."""
    peer = parity["peers"]
    assert peer["started"], peer
    found = peer["queries"]
    if parity["mode"] == "journal":
        assert "recovery from peer succeeded" in peer["log"], peer["log"]
        assert found["agree"] == found["prompts"], found["differ"]
        assert found["nonempty"] >= found["prompts"] * 0.8
    else:
        assert "404" in peer["log"] and peer["workers"] == [], peer["log"]
        assert found["agree"] < found["prompts"] * 0.2
