"""kvindex: one import name, its version, and nothing else claimed in site-packages."""

from importlib import metadata

from click.testing import CliRunner

import kvindex
from kvindex.clients.cli.main import main


def test_the_distribution_installs_one_top_level_name() -> None:
    top_level = metadata.distribution("kvindex").read_text("top_level.txt")
    assert top_level is not None
    assert top_level.split() == ["kvindex"]


def test_version_is_the_distributions() -> None:
    assert kvindex.__version__ == metadata.version("kvindex")


def test_cli_prints_the_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"kvindex, version {metadata.version('kvindex')}"
