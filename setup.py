"""Builds kvindex's compiled hot loops (``kvindex.indexer.native._core``); the rest of the
package's metadata is in pyproject.toml."""

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
            )
        ],
        compiler_directives={"language_level": "3"},
    )
)
