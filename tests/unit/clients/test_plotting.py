"""``--plot`` without the ``plot`` extra: one line that names the extra, not a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.plotting import INSTALL_HINT, PlotUnavailableError, pyplot
from tests.support.request_logs import unique_prompts, write_log

TRACE = Path(__file__).parents[3] / "bench/traces/mooncake_fast25_synthetic_trace.jsonl.gz"


@pytest.fixture
def without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import matplotlib`` raises ImportError, as where the extra is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_pyplot_is_matplotlibs_on_the_agg_backend() -> None:
    plt = pyplot()
    assert plt.__name__ == "matplotlib.pyplot"
    assert plt.get_backend().lower() == "agg"


@pytest.mark.usefixtures("without_matplotlib")
def test_without_matplotlib_pyplot_names_the_extra() -> None:
    with pytest.raises(PlotUnavailableError, match=r"pip install 'kvindex\[plot\]'"):
        pyplot()


@pytest.mark.usefixtures("without_matplotlib")
def test_simulate_plot_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    args = ["simulate", "--trace", str(TRACE), "--limit", "20", "--replicas", "2"]
    args += ["--policies", "least_load", "--plot", str(png)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == f"Error: {INSTALL_HINT}"
    assert "Traceback" not in result.output and not png.exists()
    assert "kvindex simulate:" not in result.stdout, "it ran before saying so"


@pytest.mark.usefixtures("without_matplotlib")
def test_analyze_plot_without_matplotlib_stops_before_reading(tmp_path: Path) -> None:
    log = write_log(tmp_path / "requests.jsonl", unique_prompts(3))
    png = tmp_path / "analysis.png"
    args = ["analyze", "--request-log", str(log), "--tokenizer-url", "http://127.0.0.1:9"]
    result = CliRunner().invoke(main, [*args, "--plot", str(png)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == f"Error: {INSTALL_HINT}"
    assert not png.exists()
