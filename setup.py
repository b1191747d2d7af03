"""Builds the optional C hot path (``otel_straggler/_hotpath.c``); the metadata is in pyproject.toml.

``optional=True``: without a C compiler or the Python headers the build of the extension is skipped with a
warning and the package runs its Python hot path (``otel_straggler/hot_path.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "otel_straggler._hotpath",
            ["otel_straggler/_hotpath.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
