"""kvindex answers Dynamo's standalone-indexer API as Dynamo's own indexer (ai-dynamo-runtime
1.6.1) does, on the same event streams: ``tests/support/dynamo_parity.py`` runs both."""

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


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
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
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
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
def test_a_dynamo_peer_cannot_recover_from_kvindex(parity: dict[str, Any]) -> None:
    """kvindex serves no ``GET /dump`` (docs/guides/dynamo-indexer-api.md says why): Dynamo
    started with ``--peers`` kvindex finds a 404 and starts empty."""
    peer = parity["peers"]
    assert peer["started"], peer
    assert "404" in peer["log"] and peer["workers"] == [], peer["log"]
