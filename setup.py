"""Decides whether the wheel carries the C hot path (``otel_straggler/_hotpath.c``); the metadata is in pyproject.toml.

``OTEL_STRAGGLER_BUILD_NATIVE`` picks the wheel that is built:

* unset or ``auto``: a pure ``py3-none-any`` wheel (the Python hot path, ``otel_straggler/hot_path.py``), except
  for an editable install (``pip install -e .``: a development checkout builds the extension so that the tests
  run the C path) and a ``cibuildwheel`` run (``CIBUILDWHEEL=1``). Where the extension is built this way and no C
  compiler or Python headers are at hand, it is skipped with a warning and the package runs its Python hot path;
* ``1``: build the extension and fail when it cannot be built (``cibuildwheel`` sets this: its manylinux wheels
  must carry it; so does ``OTEL_STRAGGLER_BUILD_NATIVE=1 pip install --no-binary otel-straggler otel-straggler``);
* ``0``: never build it.

The same source (checkout or sdist) gives the same wheel under any build frontend: ``python -m build`` and
``pip wheel`` give the pure wheel an index accepts; the C path is asked for, never guessed.
"""

import os
import sys

from setuptools import Extension, setup

ENV = "OTEL_STRAGGLER_BUILD_NATIVE"


def _native() -> tuple[bool, bool]:
    """(build the extension, fail when it cannot be built)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice in ("1", "true", "yes", "on"):
        return True, True
    if choice in ("0", "false", "no", "off"):
        return False, False
    if choice != "auto":
        raise SystemExit(f"{ENV}={choice!r}: use 1, 0 or auto")
    editable = "editable_wheel" in sys.argv  # setuptools' PEP 660 hook runs this command
    return editable or os.environ.get("CIBUILDWHEEL") == "1", False


build, required = _native()
setup(
    ext_modules=[
        Extension(
            "otel_straggler._hotpath",
            ["otel_straggler/_hotpath.c"],
            optional=not required,
            extra_compile_args=["-O2"],
        )
    ]
    if build
    else []
)
