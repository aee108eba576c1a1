"""Builds kvindex's compiled hot loops (``kvindex.indexer.native._core``: ingest, keys and
the memory store's tables; ``_lookup``: the read path's loops after the lookup; ``_json``:
a ``/score`` body's token ids); the rest of the package's metadata is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [
            Extension(
                "kvindex.indexer.native._core",
                ["indexer/native/_core.pyx"],
                include_dirs=["indexer/native"],
                extra_compile_args=["-O3"],
            ),
            Extension(
                "kvindex.indexer.native._lookup",
                ["indexer/native/_lookup.pyx"],
                # No fused multiply-add: the scores must round as Python's arithmetic does.
                extra_compile_args=["-O3", "-ffp-contract=off"],
            ),
            Extension(
                "kvindex.indexer.native._json",
                ["indexer/native/_json.pyx"],
                include_dirs=["indexer/native"],
                extra_compile_args=["-O3", "-ffp-contract=off"],
            ),
        ],
        compiler_directives={"language_level": "3"},
    )
)
