"""The docs stay true to the code: docs/options.md lists every ServerArgs field once with its default,
the README keeps its two set-up commands first and its size, and no code comment tells a diary."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from radixlm.runtime.server_args import ServerArgs

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
