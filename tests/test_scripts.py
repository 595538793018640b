"""scripts/server_smoke.py (what a lent GPU runs against its server, scripts/gpu_check.sh) passes
against a CPU server on a tiny random model, and fails when the server cannot start."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "server_smoke.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke(model: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--model", model, "--device", "cpu", "--port",
                           str(free_port()), "--timeout", str(timeout)], capture_output=True, text=True, timeout=300)


def test_server_smoke_passes_on_a_tiny_model(make_tiny_model):
    done = smoke(str(make_tiny_model(max_position_embeddings=2048)), 180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for check in ("ok /generate", "ok streamed chat", "ok json_schema chat", "ok bad request: 400",
                  "all checks passed"):
        assert check in done.stdout


def test_server_smoke_fails_when_the_server_cannot_start(tmp_path):
    done = smoke(str(tmp_path / "no-model"), 60)
    assert done.returncode != 0 and "exited with" in done.stdout + done.stderr
