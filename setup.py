"""Decides whether the wheel carries the C hot path (``otel_straggler/_hotpath.c``); the metadata is in pyproject.toml.

``OTEL_STRAGGLER_BUILD_NATIVE`` picks the wheel that is built:

* unset or ``auto``: the C extension where a working C compiler and the Python headers are at hand and the
  build is for this host (an editable install, ``pip install`` of the sdist, ``pip wheel``, a ``cibuildwheel``
  run); a pure ``py3-none-any`` wheel (the Python hot path, ``otel_straggler/_hotpath_py.py``) from ``python -m
  build``, which makes the distributable wheel an index accepts, and wherever no compiler works (probed before
  the build, so such a wheel is never tagged for a platform);
* ``1``: build the extension and fail when it cannot be built (``cibuildwheel`` sets this: its manylinux wheels
  must carry it);
* ``0``: never build it.
"""

import os
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup

ENV = "OTEL_STRAGGLER_BUILD_NATIVE"


def _compiler_works() -> bool:
    """Compiles and links a module that includes ``Python.h``, as the extension's build would."""
    from distutils.ccompiler import new_compiler
    from distutils.errors import CompileError, DistutilsError, LinkError
    from distutils.sysconfig import customize_compiler

    cc = new_compiler()
    customize_compiler(cc)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w", encoding="ascii") as f:
            f.write("#include <Python.h>\nint probe(void) { return (int)Py_None == 0; }\n")
        try:
            objs = cc.compile([src], output_dir=tmp, include_dirs=[sysconfig.get_paths()["include"]])
            cc.link_shared_object(objs, os.path.join(tmp, "probe.so"))
        except (CompileError, LinkError, DistutilsError, OSError):
            return False
    return True


def _native() -> tuple[bool, bool]:
    """(build the extension, fail when it cannot be built)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice in ("1", "true", "yes", "on"):
        return True, True
    if choice in ("0", "false", "no", "off"):
        return False, False
    if choice != "auto":
        raise SystemExit(f"{ENV}={choice!r}: use 1, 0 or auto")
    for_this_host = (
        "editable_wheel" in sys.argv  # setuptools' PEP 660 hook: a development checkout
        or "PIP_BUILD_TRACKER" in os.environ  # pip builds the wheel it installs (or `pip wheel`)
        or os.environ.get("CIBUILDWHEEL") == "1"
    )
    if not for_this_host:
        return False, False
    if not _compiler_works():
        print(f"otel-straggler: no working C compiler; building the pure wheel (Python hot path). {ENV}=1 "
              "makes this an error.", file=sys.stderr)
        return False, False
    return True, False


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
