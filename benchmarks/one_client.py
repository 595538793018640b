"""One client's decode speed against llama.cpp's llama-server on the same GGUF and machine.

    python benchmarks/one_client.py [--modes fp16,int4,int4:compiled] [--llama-server PATH] [--rounds 6] [--tokens 128]
        [--threads 2] [--json benchmarks/results/one_client.json]

Each server in turn (ours once per `--quantization` mode, `:compiled` adding --enable-torch-compile,
then llama-server with `-t THREADS -np 1
--no-repack`) gets the same chat prompt `--rounds` times, streamed through /v1/completions with
greedy sampling and `--tokens` new tokens (EOS ignored); decode speed is the tokens after the first
over the time from the first to the last, and a server's figure is the median of its rounds. The
ratio is against llama-server measured in the same run. `--llama-server` defaults to what
`bash ../shared/peers/build_llama_server.sh` prints; without one the ratio column is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from radixlm.runtime.executor.cpu.int4 import gguf_source  # noqa: E402
from radixlm.runtime.executor.loader import resolve_model  # noqa: E402

PROMPT = ("<|im_start|>user\nWrite a long story about a lighthouse keeper and a storm.<|im_end|>\n"
          "<|im_start|>assistant\n")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up")


def _round(url: str, tokens: int, extra: dict) -> float:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, **extra}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url} streamed {len(stamps)} pieces")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(cmd: list[str], url: str, rounds: int, tokens: int, extra: dict, env: dict, bar) -> float:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait(url, proc)
        _round(url, 8, extra)  # warm-up
        speeds = []
        for _ in range(rounds):
            speeds.append(_round(url, tokens, extra))
            bar.update(1)
        return statistics.median(speeds)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="fp16,int4,int4:compiled")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/one_client.json")
    a = p.parse_args(argv)
    gguf = gguf_source(resolve_model(a.model).folder)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    modes = [m for m in a.modes.split(",") if m]
    results: dict[str, float] = {}
    with tqdm(total=a.rounds * (len(modes) + bool(a.llama_server)), desc="rounds") as bar:
        for mode in modes:
            port = _port()
            quant, _, how = mode.partition(":")
            cmd = [sys.executable, "-m", "radixlm.server", "--model", a.model, "--port", str(port),
                   "--quantization", quant, "--log-level", "warning"] + (["--enable-torch-compile"] if how else [])
            results[f"radixlm {mode}"] = measure(cmd, f"http://127.0.0.1:{port}", a.rounds, a.tokens,
                                                 {"ignore_eos": True}, env, bar)
        if a.llama_server and gguf is not None:
            port = _port()
            cmd = [a.llama_server, "-m", str(gguf), "--port", str(port), "-t", str(a.threads), "-np", "1", "-c",
                   "8192", "--no-repack"]
            results["llama-server"] = measure(cmd, f"http://127.0.0.1:{port}", a.rounds, a.tokens,
                                              {"ignore_eos": True}, env, bar)
    base = results.get("llama-server")
    print("| server | decode tok/s | / llama-server |\n|---|--:|--:|")
    for name, speed in results.items():
        print(f"| {name} | {speed:.1f} | {f'{speed / base:.2f}x' if base else '—'} |")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
