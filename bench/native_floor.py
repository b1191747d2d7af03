"""How much of a start+stop's in-situ cost a hot path in C would leave: the measurement behind a native hot path.

Between a step's operations a start+stop of the Python timers costs several times its tight-loop time (its code
and data are cold; ``bench/in_situ.py``, ``bench/results/gpu-h200.md`` runs 9c and 10). This bench compiles
``bench/native/floor.c`` (a host-only timers object in C with Megatron's call shape: a dict lookup by name, a
clock read, one ring slot of plain integers; no device events, no readout; not part of otel_straggler) with the
system's C compiler, and runs ``bench/in_situ.py``'s rounds with it as one more arm (``native``) beside the no-op
call shape and the real timers on a host-only step. It needs a C compiler and the Python headers; without them it
says so and exits 0.

Usage: ``python bench/native_floor.py`` (``--device cuda`` on a GPU machine). Last line:
``native_us_ops3= native_us_ops30= native-noclock_us_ops30= host_us_ops3= host_us_ops30= noop_us_ops30=``
(``host`` is the package's hot path, C or Python as ``hot_path=`` says). Arm ``native-noclock``: the same C object
with a counter for a clock (what the clock reads cost there).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from in_situ import after_3_and_30, arguments  # noqa: E402

from otel_straggler import hot_path  # noqa: E402


def build() -> object | None:
    """The compiled ``floor`` module, or None when no C compiler or no Python headers are at hand. A module built
    beforehand next to the source (``bench/native/floor<EXT_SUFFIX>``, for a machine without a compiler, such as
    the lent GPU machine; ``scripts/gpu-native`` makes it) is used as it is."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = HERE / "native" / f"floor{suffix}"
    if not out.exists() or out.stat().st_mtime < (HERE / "native" / "floor.c").stat().st_mtime:
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        include = sysconfig.get_paths()["include"]
        if cc is None or not (Path(include) / "Python.h").exists():
            return None
        out = Path(tempfile.mkdtemp(prefix="native-floor-")) / f"floor{suffix}"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(HERE / "native" / "floor.c"), "-o",
                        str(out)], check=True)
    spec = importlib.util.spec_from_file_location("floor", out)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, argv)
    floor = build()
    if floor is None:
        print("no C compiler or Python headers: nothing measured")
        return 0
    native = floor.Timers()
    res = after_3_and_30(args, {"native": native, "native-noclock": floor.Timers(clock=False)})
    assert native.intervals() > 0
    print(f"hot_path={hot_path.NAME}")
    print(" ".join(f"{arm}_us_ops{ops}={res[ops][arm]['mean_us']:.2f}"
                   for arm, ops in (("native", 3), ("native", 30), ("native-noclock", 30), ("host", 3), ("host", 30),
                                    ("noop", 30))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
