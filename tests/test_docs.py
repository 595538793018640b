"""The docs stay true to the code: docs/options.md lists every ServerArgs field once with its default,
the README keeps its two set-up commands first and its size, and no code comment tells a diary."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from radixlm.runtime import launch_flags
from radixlm.runtime.engine_args import EngineArgs
from radixlm.server.server_args import ServerArgs

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(\w+)` \| (.*?) \| .+ \|$")


def test_options_md_lists_every_option_with_its_default():
    rows = [ROW.match(line) for line in (ROOT / "docs" / "options.md").read_text().splitlines()]
    listed = {m.group(1): m.group(2) for m in rows if m}
    fields = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    assert sorted(listed) == sorted(fields), (set(listed) ^ set(fields))
    for name, default in fields.items():
        shown = listed[name].strip("`")
        want = '""' if default == "" else default if isinstance(default, str) else repr(default)
        assert shown == want, (name, shown, default)
    server_section = (ROOT / "docs" / "options.md").read_text().split("## HTTP server", 1)[1].split("\n## ", 1)[0]
    server_only = set(fields) - {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(re.findall(r"^\| `(\w+)`", server_section, re.M)) == server_only
    assert server_only == launch_flags.SERVER_ONLY  # what Engine(**kwargs) accepts and ignores


def test_readme_opens_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    commands = [line for line in lines[:15] if line.startswith("bash scripts/")]
    assert [c.split("#")[0].strip() for c in commands] == ["bash scripts/serve.sh", "bash scripts/test.sh"]
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= 400


def test_no_dated_diary_or_issue_numbers_in_product_code():
    """Comments say why, in the present tense; figures and their dates live in benchmarks/README.md."""
    diary = re.compile(r"20\d\d-[01]\d-[0-3]\d|[Ii]ssue \d+|\b(?:before|after) [0-9a-f]{7}\b")
    files = subprocess.run(["git", "ls-files", "lang", "runtime", "radix_cache", "constrained", "server"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{f}:{i}" for f in files if f.endswith(".py")
             for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if diary.search(line)]
    assert found == [], found


def test_server_uses_only_the_runtime_surface_docs_architecture_names():
    """Layering runs one way: server/ imports from radixlm.runtime only the names
    docs/architecture.md lists under "The runtime's public surface" (a new one is added there first)."""
    import ast

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The runtime's public surface", 1)[1].split("\n## ", 1)[0]
    listed = {(f"radixlm.runtime.{m}", name.strip(" `")) for m, names in
              re.findall(r"^- `([\w.]+)`: (.+)$", section, re.M) for name in names.split(",")}
    used = set()
    for path in (ROOT / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("radixlm.runtime"):
                used |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("radixlm.runtime") for a in node.names), path
    assert used <= listed, sorted(used - listed)
    assert listed <= used, f"docs/architecture.md lists names server/ no longer uses: {sorted(listed - used)}"
    # and never back: the runtime imports nothing of the server (its package keeps one lazy alias,
    # radixlm.runtime.ServerArgs, the server's options under their old import path)
    for path in (ROOT / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("radixlm.server"):
                assert (path.name, module) == ("__init__.py", "radixlm.server.server_args"), (path, module)
