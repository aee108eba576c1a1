"""matplotlib for the ``--plot`` options, from the optional ``kvindex[plot]`` extra."""

from __future__ import annotations

from types import ModuleType

from kvindex.indexer.domain.errors import KvIndexError

INSTALL_HINT = "--plot needs matplotlib, which is not installed: pip install 'kvindex[plot]'"


class PlotUnavailableError(KvIndexError):
    """``--plot`` without the ``plot`` extra installed."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend, imported on first use."""
    try:
        import matplotlib  # noqa: PLC0415 (heavy, and an optional extra)
    except ImportError as exc:
        raise PlotUnavailableError(INSTALL_HINT) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt
