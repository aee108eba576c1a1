"""Fixtures of the fault suite: a fresh deployment per test, the scale (short or long
form), and the table of convergence times printed at the end of the run."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.faults.convergence import Convergence, Recorder
from tests.faults.fleet import FaultFleet, FleetShape
from tests.faults.scale import LONG, LONG_SCALE, SHORT_SCALE, Scale

LONG_TIMEOUT_S = 600

_RESULTS = pytest.StashKey[list[Convergence]]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long form may take minutes per test: raise pytest-timeout's limit for it only."""
    if not LONG:
        return
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.fixture
def scale() -> Scale:
    return LONG_SCALE if LONG else SHORT_SCALE


@pytest.fixture
def shape() -> FleetShape:
    """Overridden by a test module (or ``pytest.mark.parametrize``) that deploys otherwise."""
    return FleetShape()


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Remember a failed call, so the fleet fixture can print its processes' logs."""
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture
def fleet(
    shape: FleetShape, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[FaultFleet]:
    """The deployment, started and live; every process stopped after, on failure too
    (then the processes' logs are printed, for the report)."""
    deployment = FaultFleet.build(shape, tmp_path)
    try:
        try:
            deployment.start()
        except BaseException:
            print(deployment.logs())
            raise
        yield deployment
        if request.node.stash.get(_FAILED, False):
            print(deployment.logs())
    finally:
        deployment.stop()


@pytest.fixture
def recorder(request: pytest.FixtureRequest) -> Recorder:
    """Measures convergence and keeps each measure for the summary table."""
    results = request.config.stash.setdefault(_RESULTS, [])
    return Recorder(results)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section(f"fault convergence ({'long' if LONG else 'short'} form)")
    for line in Recorder.table(results):
        terminalreporter.write_line(line)
