"""What a release publishes: the default wheel is pure Python (``py3-none-any``, an index accepts it), the sdist
builds the C hot path where pip installs it with a working compiler, the manylinux wheels come from the
``[tool.cibuildwheel]`` configuration, and the metadata (license, classifiers, URLs, version, extras) is complete
and ``twine check`` clean."""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging_support import ROOT, Dist, build_env

import otel_straggler

COLLECTOR_ONLY = {"pydantic", "pyyaml", "prometheus-client", "protobuf", "opentelemetry-proto"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_the_build_raises_no_deprecation_warning(dist: Dist) -> None:
    assert "deprecat" not in dist.log.lower(), [ln for ln in dist.log.splitlines() if "eprecat" in ln]


def test_the_default_wheel_is_pure_python(dist: Dist) -> None:
    assert dist.wheel.name == f"otel_straggler-{otel_straggler.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(dist.wheel) as zf:
        names = zf.namelist()
        (wheel_file,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        wheel_meta = zf.read(wheel_file).decode()
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta
    assert not [n for n in names if n.endswith((".so", ".pyd", ".c"))], "no compiled code and no C source"


def test_the_wheel_carries_types_license_config_and_entry_points(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as zf:
        names = set(zf.namelist())
        (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(eps).decode()
        config = zf.read("collector_processor/config/collector.yaml").decode()
    assert {"otel_straggler/py.typed", "otel_straggler_schema/py.typed", "collector_processor/py.typed"} <= names
    assert {n.split("/", 1)[0] for n in names if n.endswith(".py")} == {
        "otel_straggler", "otel_straggler_schema", "otel_straggler_demo", "collector_processor"}  # not jobsim
    assert {"otel_straggler_schema/__init__.py", "otel_straggler_schema/stages.py", "otel_straggler/schema.py",
            "otel_straggler_demo/cli.py", "otel_straggler_demo/run.py"} <= names
    assert f"otel_straggler-{otel_straggler.__version__}.dist-info/licenses/LICENSE" in names
    assert config == (ROOT / "collector_processor/config/collector.yaml").read_text(encoding="utf-8")
    assert "otel-straggler = otel_straggler.cli:main" in entry_points
    assert "otel-straggler-collector = collector_processor.entry:main" in entry_points
    assert "[opentelemetry_instrumentor]\notel_straggler = otel_straggler.instrumentation:MegatronInstrumentor" \
        in entry_points
    assert not [n for n in names if n.startswith(("tests/", "bench/", "configs/"))]


def test_metadata_license_classifiers_urls_and_version(dist: Dist) -> None:
    meta = _metadata(dist.wheel)
    assert meta["Metadata-Version"] >= "2.4"
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["License"] is None, "PEP 639: the expression, not the old free-text field"
    classifiers = meta.get_all("Classifier")
    assert not [c for c in classifiers if c.startswith("License ::")], "PEP 639 forbids license classifiers"
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in classifiers
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues", "Changelog", "Documentation"} <= set(urls)
    assert meta["Version"] == otel_straggler.__version__
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{otel_straggler.__version__}]" in changelog


def test_the_version_has_one_source() -> None:
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "otel_straggler.version.__version__"}
    from importlib.metadata import version

    from otel_straggler import version as version_module

    assert version("otel-straggler") == otel_straggler.__version__ == version_module.__version__


def test_the_plain_install_is_the_emitter_and_the_collector_is_an_extra(dist: Dist) -> None:
    requires = _metadata(dist.wheel).get_all("Requires-Dist")
    base = {_requirement_name(r) for r in requires if "extra ==" not in r}
    collector = {_requirement_name(r) for r in requires if 'extra == "collector"' in r}
    assert base >= {"opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
                    "opentelemetry-instrumentation"}
    assert not base & COLLECTOR_ONLY, base & COLLECTOR_ONLY
    assert "torch" not in base, "torch is the training image's own"
    assert collector >= COLLECTOR_ONLY | {"grpcio"}


def test_twine_check_is_clean(dist: Dist) -> None:
    pytest.importorskip("twine")
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2


def test_the_sdist_holds_the_c_source_and_the_build_script(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"otel_straggler/_hotpath.c", "setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "PKG-INFO",
            "collector_processor/config/collector.yaml", "otel_straggler/py.typed", "otel_straggler_schema/py.typed",
            "otel_straggler_schema/__init__.py", "otel_straggler_demo/cli.py"} <= names
    assert not [n for n in names if n.startswith("tests/")]


def _pip_install_sdist(dist: Dist, tmp_path: Path, **env: str) -> Path:
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--target", str(target), str(dist.sdist)],
                          capture_output=True, text=True, timeout=600, env=build_env(**env), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return target


@pytest.mark.slow
@pytest.mark.parametrize("switch", [{}, {"OTEL_STRAGGLER_BUILD_NATIVE": "1"}, {"CIBUILDWHEEL": "1"}],
                         ids=["default", "OTEL_STRAGGLER_BUILD_NATIVE", "cibuildwheel"])
def test_installing_the_sdist_builds_the_c_hot_path_where_a_compiler_works(dist: Dist, tmp_path: Path,
                                                                          switch: dict[str, str]) -> None:
    """Where a C compiler is at hand, ``pip install`` of the sdist builds the C path by default (as
    ``pip install --no-binary otel-straggler otel-straggler`` does), and so do cibuildwheel's manylinux containers
    and the explicit switch."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    target = _pip_install_sdist(dist, tmp_path, **switch)
    assert list((target / "otel_straggler").glob("_hotpath*.so")), "the C extension was built and installed"
    check = ("import json, otel_straggler; from otel_straggler import hot_path; "
             "print(json.dumps([hot_path.NAME, otel_straggler.__file__]))")
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=build_env(PYTHONPATH=str(target), OTEL_STRAGGLER_HOT_PATH="native"))
    assert run.returncode == 0, run.stderr[-3000:]
    name, where = __import__("json").loads(run.stdout)
    assert name == "native" and Path(where).is_relative_to(target)


@pytest.mark.slow
def test_without_a_working_compiler_pip_builds_the_pure_wheel(dist: Dist, tmp_path: Path) -> None:
    """No compiler that works (``CC`` names one that fails): the wheel pip builds from the sdist is the pure one,
    never a platform-tagged wheel without the extension, and the build says why."""
    out = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-v", "-w", str(out), str(dist.sdist)],
                          capture_output=True, text=True, timeout=600, env=build_env(CC="false"), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (wheel,) = out.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("otel_straggler/_hotpath.")]
    assert "no working C compiler" in proc.stdout + proc.stderr


def test_the_wheel_built_from_the_sdist_by_default_is_pure(dist: Dist) -> None:
    """``python -m build`` built the wheel from the sdist (its default): no switch, no C path."""
    assert dist.wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(dist.wheel).namelist()
    assert "otel_straggler/_hotpath_py.py" in names  # the Python twin; no C module (``_hotpath.<abi>.so``)
    assert not [n for n in names if n.startswith("otel_straggler/_hotpath.")]


def test_the_cibuildwheel_configuration_builds_manylinux_wheels_with_the_c_path() -> None:
    cfg = _pyproject()["tool"]["cibuildwheel"]
    assert cfg["environment"] == {"OTEL_STRAGGLER_BUILD_NATIVE": "1"}, "the platform wheels must carry the C path"
    test = cfg["test-command"]
    assert "hot_path.NAME == 'native'" in test and "OTEL_STRAGGLER_HOT_PATH=native" in test
    assert cfg["linux"]["repair-wheel-command"].startswith("auditwheel repair")
    exe = Path(sys.executable).with_name("cibuildwheel")
    if not exe.exists():
        pytest.skip("cibuildwheel is not installed")
    # cibuildwheel reads and validates the configuration without containers when it only lists what it would build
    proc = subprocess.run([str(exe), "--print-build-identifiers", "--platform", "linux", "--archs", "x86_64,aarch64"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = set(proc.stdout.split())
    for py in ("cp311", "cp312", "cp313"):
        assert {f"{py}-manylinux_x86_64", f"{py}-manylinux_aarch64"} <= ids, ids
    assert not [i for i in ids if "musllinux" in i or i.startswith(("cp38", "cp39", "cp310", "pp"))], ids


RELEASE_PYTHONS = ("3.11", "3.12", "3.13")  # [tool.cibuildwheel] build = "cp311-* cp312-* cp313-*"


def _host_pythons() -> dict[str, str]:
    """minor version -> interpreter, for the release's CPython versions found on this host: pyenv's (the newest
    patch of each minor), else ``python3.X`` on PATH."""
    found: dict[str, str] = {}
    roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))]
    if shutil.which("pyenv"):
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30).stdout.strip()
        roots.insert(0, Path(out)) if out else None
    for minor in RELEASE_PYTHONS:
        for root in roots:
            pys = sorted((root / "versions").glob(f"{minor}.*/bin/python{minor}"),
                         key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])])
            if pys:
                found[minor] = str(pys[-1])
                break
        else:
            if exe := shutil.which(f"python{minor}"):
                found[minor] = exe
    return found


def _setuptools_only(tmp: Path) -> Path:
    """A directory holding only this environment's setuptools (pure Python, with its vendored packages), for
    another interpreter's PYTHONPATH: the build runs without isolation and without the network, as the
    ``dist`` fixture's does, on interpreters that carry no (or an older) setuptools."""
    import setuptools

    shim = tmp / "setuptools-only"
    shim.mkdir(exist_ok=True)
    site = Path(setuptools.__file__).parent.parent
    # its dist-info too: setuptools finds its own commands (dist_info, bdist_wheel) through its entry points
    names = ["setuptools", "pkg_resources", "_distutils_hack", f"setuptools-{setuptools.__version__}.dist-info"]
    for name in names:
        if (site / name).exists() and not (shim / name).exists():
            (shim / name).symlink_to(site / name)
    return shim


def test_the_release_pythons_are_on_this_host_under_ci() -> None:
    """Under CI the per-Python wheel test below must not skip its way to green: two of the release's Pythons at
    least."""
    found = _host_pythons()
    if os.environ.get("CI") != "true":
        pytest.skip(f"not CI; found {sorted(found)}")
    assert len(found) >= 2, f"CPython {RELEASE_PYTHONS}: only {sorted(found)} on this host"


@pytest.mark.slow
@pytest.mark.parametrize("minor", RELEASE_PYTHONS)
def test_the_release_switch_builds_a_c_path_wheel_for_each_host_python(dist: Dist, tmp_path: Path,
                                                                       minor: str) -> None:
    """What cibuildwheel runs in each manylinux container, run here with each of the release's Pythons this host
    has: a wheel built from the sdist with the ``[tool.cibuildwheel]`` ``environment``
    (``OTEL_STRAGGLER_BUILD_NATIVE=1``), installed into a throwaway venv of that Python, where its C path loads
    (the ``test-command``'s check). The manylinux containers themselves are not run: they need Docker or Podman,
    which this repository's test machines lack; the wheel is the host's (``linux_*`` tag; the release's
    ``auditwheel repair`` step retags it manylinux). A Python the host lacks skips (see the CI test above)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    python = _host_pythons().get(minor)
    if python is None:
        pytest.skip(f"no CPython {minor} on this host")
    abi = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    out = tmp_path / "wheels"
    env = build_env(**_pyproject()["tool"]["cibuildwheel"]["environment"], PYTHONPATH=str(_setuptools_only(tmp_path)))
    proc = subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-w", str(out), str(dist.sdist)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (wheel,) = out.glob("*.whl")
    py = "cp" + minor.replace(".", "")
    assert re.search(rf"-{py}-{py}-linux_[a-z0-9_]+\.whl$", wheel.name), wheel.name
    assert f"otel_straggler/_hotpath{abi}" in zipfile.ZipFile(wheel).namelist(), (abi, wheel.name)

    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    vpy = str(venv / "bin" / "python")
    inst = subprocess.run([vpy, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                           str(wheel)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert inst.returncode == 0, (inst.stdout + inst.stderr)[-3000:]
    check = ("import json, sys, otel_straggler; from otel_straggler import hot_path; "
             "print(json.dumps([hot_path.NAME, hot_path.REASON, otel_straggler.__file__, sys.prefix]))")
    run = subprocess.run([vpy, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**build_env(OTEL_STRAGGLER_HOT_PATH="native"), "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    name, reason, where, prefix = __import__("json").loads(run.stdout)
    assert name == "native", reason
    assert Path(where).is_relative_to(venv) and Path(prefix) == venv, (where, prefix)


def test_the_readme_says_which_wheel_carries_the_c_path() -> None:
    """The README tells the release wheels apart: the manylinux wheels (cibuildwheel) carry the C path, the
    pure wheel (``python -m build``) runs the Python one, and ``otel-straggler --version`` says which runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    para = next(p for p in readme.split("\n\n") if "manylinux" in p)
    for words in ("cibuildwheel", "python -m build", "py3-none-any", "otel-straggler --version",
                  "OTEL_STRAGGLER_BUILD_NATIVE=1"):
        assert words in para, words
