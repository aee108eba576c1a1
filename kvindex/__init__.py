"""kvindex: where every KV-cache block of a vLLM fleet lives.

One import name for the three rooms of the tree, which sit beside this folder:

    kvindex.indexer   the write path: vLLM KV events → ordered ingestion → the block index
    kvindex.api       the read path: ``POST /score`` and the HTTP service around it
    kvindex.clients   what uses the two: the Python client, the CLI, a fake vLLM, the simulator

An installed kvindex holds them under this package (``pyproject.toml`` maps each folder with
``package-dir``); in a checkout, ``kvindex/indexer``, ``kvindex/api`` and ``kvindex/clients``
are links to the same folders, so tools that read the tree (mypy, pytest) see the same names.
"""


def __getattr__(name: str) -> str:
    # __version__ is read from the installed metadata on first use: importing
    # importlib.metadata costs every CLI call tens of milliseconds.
    if name != "__version__":
        raise AttributeError(f"module 'kvindex' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("kvindex")
    except PackageNotFoundError:  # a checkout used without installing it
        return "0+unknown"
