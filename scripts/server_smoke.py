"""A served model answers real requests: starts `python -m radixlm.server` on a loopback port, then
checks SGLang's /generate, a streamed OpenAI chat completion and a json_schema-constrained one
(parsed and checked against the schema), and that a bad request gets a 400; prints one line per
check and exits non-zero on the first failure. For a device the tests do not cover through HTTP
(a lent GPU: scripts/gpu_check.sh runs it with --device cuda on the random twin of the model).

    python scripts/server_smoke.py --model PATH_OR_ALIAS [--device cuda] [--port 30111] [--timeout 180]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def post(url: str, body: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout:g}s")


def checks(base: str, timeout: float) -> None:
    status, body = post(base + "/generate", {"text": "The capital of France is",
                                             "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout)
    out = json.loads(body)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 8, (status, body[:300])
    print(f"ok /generate: {out['text']!r}")

    chat = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    status, body = post(base + "/v1/chat/completions", chat, timeout)
    chunks = [json.loads(line[5:]) for line in body.decode().splitlines()
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert status == 200 and chunks and body.decode().rstrip().endswith("data: [DONE]"), (status, body[:300])
    print(f"ok streamed chat: {len(chunks)} chunks, {text!r}")

    constrained = {**chat, "stream": False, "max_tokens": 64,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    status, body = post(base + "/v1/chat/completions", constrained, timeout)
    choice = json.loads(body)["choices"][0]
    assert status == 200, (status, body[:300])
    if choice["finish_reason"] == "stop":  # a random model may run out of tokens first
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 10, value
    print(f"ok json_schema chat ({choice['finish_reason']}): {choice['message']['content']!r}")

    status, body = post(base + "/v1/chat/completions", {**chat, "stream": False, "temperature": -1}, timeout)
    assert status == 400, (status, body[:300])
    print(f"ok bad request: {status} {json.loads(body).get('error', {}).get('message', body[:120])!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--port", type=int, default=30111)
    p.add_argument("--timeout", type=float, default=180, help="seconds for the server to start")
    args = p.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.server", "--model", args.model, "--device", args.device,
                             "--host", "127.0.0.1", "--port", str(args.port)], env=env)
    try:
        base = f"http://127.0.0.1:{args.port}"
        wait_ready(base, proc, args.timeout)
        checks(base, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("server smoke: all checks passed")


if __name__ == "__main__":
    main()
