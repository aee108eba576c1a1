"""Dynamo's standalone indexer for the parity test: ``ai-dynamo-runtime`` in a venv of its own
under ``build/`` (created once, then reused), and a private network namespace to run it in
(its HTTP server binds 0.0.0.0). Either missing is a reason to skip, said in full."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

DYNAMO_RUNTIME = "ai-dynamo-runtime==1.6.1"
VENV = ROOT / "build" / "dynamo-venv"


class UnavailableError(Exception):
    """Why Dynamo's indexer cannot run here."""


def _works(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import dynamo.indexer"], capture_output=True, check=False
    )
    return probe.returncode == 0


def dynamo_python() -> Path:
    """The venv's python, the venv created first if needed (a minute, ~300 MB)."""
    python = VENV / "bin" / "python"
    if _works(python):
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", DYNAMO_RUNTIME],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UnavailableError(f"{' '.join(step[-2:])}: {exc}") from None
        if done.returncode != 0:
            raise UnavailableError(f"{' '.join(step[-2:])} failed: {done.stderr.strip()[-400:]}")
    if not _works(python):
        raise UnavailableError(f"{DYNAMO_RUNTIME} installed but `import dynamo.indexer` fails")
    return python


def private_network() -> list[str]:
    """The command prefix running a child in a network namespace of its own."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise UnavailableError(
            "no `unshare`: Dynamo's indexer binds 0.0.0.0, run only in a private netns"
        )
    probe = subprocess.run([unshare, "-n", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise UnavailableError(
            "`unshare -n` refused (needs root or CAP_SYS_ADMIN): Dynamo's indexer binds 0.0.0.0, "
            f"run only in a private netns: {probe.stderr.strip()[-200:]}"
        )
    return [unshare, "-n", "--"]
