"""Every package folder is listed in pyproject, so nothing silently drops out of a wheel."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(conf["tool"]["setuptools"]["packages"])
    mapping = conf["tool"]["setuptools"]["package-dir"]
    folder_of = {pkg: folder for pkg, folder in mapping.items()}
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        top = rel.parts[0]
        if top.startswith(".") or top in {"tests", "benchmarks", "examples", "build"}:
            continue
        # the deepest mapped folder holding it: server/launch_server is radixlm.launch_server, not radixlm.server.*
        depth = max((n for n in range(1, len(rel.parts) + 1) if "/".join(rel.parts[:n]) in folder_of.values()),
                    default=0)
        assert depth, f"folder {top}/ has an __init__.py but no package-dir mapping"
        pkg = next(p for p, f in folder_of.items() if f == "/".join(rel.parts[:depth]))
        found.add(".".join([pkg, *rel.parts[depth:]]))
    assert found - listed == set(), f"package folders missing from pyproject: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject lists packages with no folder: {sorted(listed - found)}"


def test_cpu_import_has_no_cuda_side_effects():
    import radixlm.constrained  # noqa: F401
    import radixlm.lang  # noqa: F401
    import radixlm.radix_cache  # noqa: F401
    import radixlm.runtime  # noqa: F401
    import radixlm.server  # noqa: F401


def test_wheel_carries_the_cache_page(tmp_path):
    """GET /cache/view serves server/static/* from the installed package: the wheel must hold them."""
    import shutil
    import subprocess
    import sys
    import zipfile

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    for folder in set(conf["tool"]["setuptools"]["package-dir"].values()):
        top = folder.split("/")[0]
        if not (src / top).exists():
            shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("radixlm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = {f"radixlm/server/static/{p.name}" for p in (ROOT / "server" / "static").iterdir() if p.is_file()}
    assert static and static <= names, sorted(static - names)
