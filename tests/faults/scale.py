"""How hard the fault tests push: the short form (CI, ``make test``) or the long one
(``KVINDEX_FAULTS_LONG=1``: more traffic, more rounds, longer outages)."""

from __future__ import annotations

import os
from dataclasses import dataclass

LONG = os.environ.get("KVINDEX_FAULTS_LONG") == "1"


@dataclass(frozen=True, slots=True)
class Scale:
    """How hard one fault test pushes: the short form runs in CI, the long one by hand."""

    num_prompts: int
    """Prompts driven before and during each fault (each replica gets half)."""
    outage_s: float
    """How long Redis or the indexer stays down (killed or stopped)."""
    num_rounds: int
    """Times each fault is injected and healed in one test."""
    hold_s: float
    """After convergence, how long every answer is checked again (no wrong route)."""
    num_flood: int
    """Large prompts sent while the indexer is stopped, to push frames past the HWM."""


SHORT_SCALE = Scale(num_prompts=24, outage_s=1.0, num_rounds=1, hold_s=0.5, num_flood=60)
LONG_SCALE = Scale(num_prompts=96, outage_s=4.0, num_rounds=3, hold_s=3.0, num_flood=300)
