"""kvindex: where every KV-cache block of a vLLM fleet lives.

One import name for the three rooms of the tree, which sit beside this folder:

    kvindex.indexer   the write path: vLLM KV events → ordered ingestion → the block index
    kvindex.api       the read path: ``POST /score`` and the HTTP service around it
    kvindex.clients   what uses the two: the Python client, the CLI, a fake vLLM, the simulator

An installed kvindex holds them under this package (``pyproject.toml`` maps each folder with
``package-dir``); in a checkout, ``kvindex/indexer``, ``kvindex/api`` and ``kvindex/clients``
are links to the same folders, so tools that read the tree (mypy, pytest) see the same names.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvindex")
except PackageNotFoundError:  # a checkout used without installing it
    __version__ = "0+unknown"
