"""Quality of each `--quantization` mode against float32: perplexity and greedy agreement.

    python benchmarks/quality.py [--model smollm2-135m] [--modes none,int8,fp16] [--window 512]
        [--prompts 16] [--prompt-tokens 64] [--gen-tokens 128] [--threads 0] [--out benchmarks/results/quality.json]
        [--llama-perplexity PATH] [--llama-server PATH]

The text is `benchmarks/data/quality_text.txt` (public domain: the Declaration of Independence, the
Gettysburg Address, Lincoln's Second Inaugural; ~2,850 tokens with SmolLM2's tokenizer). Per mode, on
the runtime's own Engine:

- perplexity: the text cut into windows of `--window` tokens, each scored alone (prefill only,
  input logprobs); exp of the mean negative log-likelihood of every token but each window's first;
- teacher-forced top-1 agreement: at every scored position, does the mode's most likely next token
  equal float32's;
- greedy agreement: `--prompts` prompts of `--prompt-tokens` tokens taken at even offsets in the
  text, `--gen-tokens` greedy tokens each (EOS ignored); tokens equal to float32's before the first
  difference, over all generated tokens, and how many continuations are identical.

Against llama.cpp on the model's GGUF (the built-in model's): `--llama-perplexity` runs its
`llama-perplexity -c WINDOW` on the same text, which scores the second half of each whole window
(the first half is context), and every mode is scored that way too ("llama.cpp's windows");
`--llama-server` asks llama-server (`-t 2`) for the same greedy continuations and counts how many of
each mode's tokens equal its before the first difference. Build them with
`bash ../shared/peers/build_llama_server.sh`, then `cmake --build build --target llama-perplexity`
in its llama.cpp folder.

The issue's rule for the CPU default: the fastest mode whose perplexity is within 1% of float32
(`PPL_TOLERANCE`); the table marks each mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

TEXT = Path(__file__).with_name("data") / "quality_text.txt"
PPL_TOLERANCE = 0.01  # a mode qualifies for the CPU default within 1% of float32's perplexity
REFERENCE = "none"


def score_windows(engine, ids: list[int], window: int) -> tuple[float, int, list[int]]:
    """(sum of negative log-likelihoods, tokens scored, argmax next token at every scored position)."""
    nll, count, top1 = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        out = engine.generate(input_ids=chunk, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0, top_logprobs_num=1)
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta["input_token_logprobs"][1:]]  # the first token has no context
        nll -= sum(logprobs)
        count += len(logprobs)
        top1 += [entries[0][1] for entries in meta["input_top_logprobs"][1:]]
    return nll, count, top1


def score_second_halves(engine, ids: list[int], window: int) -> tuple[float, int]:
    """llama-perplexity's protocol: whole windows only, each scored on the tokens of its second half
    (position window / 2 + 1 on, predicted from everything before it in the window)."""
    nll, count, start_len = 0.0, 0, window // 2 + 1
    for start in range(0, len(ids) - window + 1, window):
        out = engine.generate(input_ids=ids[start:start + window], sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=start_len)
        logprobs = [entry[0] for entry in out["meta_info"]["input_token_logprobs"]]
        nll -= sum(logprobs)
        count += len(logprobs)
    return nll, count


def llama_perplexity(binary: str, gguf: Path, text: str, window: int, threads: int) -> float:
    """llama-perplexity's final estimate on `text` with windows of `window` tokens."""
    import re
    import subprocess

    out = subprocess.run([binary, "-m", str(gguf), "-f", text, "-c", str(window), "-b", str(window),
                          "-t", str(threads)], capture_output=True, text=True, timeout=1800)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
    return float(found.group(1))


def llama_server_greedy(binary: str, gguf: Path, prompts: list[list[int]], gen_tokens: int) -> list[list[int]]:
    """llama-server's greedy continuations of the prompts (token ids in, token ids out, EOS ignored)."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", "2",
                             "-np", "1", "-c", "4096", "--no-repack"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not come up")
            time.sleep(0.3)
        outs = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": gen_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            r = httpx.post(url + "/completion", json=body, timeout=600)
            r.raise_for_status()
            outs.append(r.json()["tokens"])
        return outs
    finally:
        proc.terminate()
        proc.wait(30)


def greedy(engine, prompts: list[list[int]], gen_tokens: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": gen_tokens, "ignore_eos": True}
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_mode(model: str, mode: str, ids: list[int], prompts: list[list[int]], args) -> dict:
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cpu.int8_file import mapped_resident_bytes, mapped_weight_bytes
    from radixlm.runtime.executor.cpu.quantization import resident_weight_bytes

    started = time.perf_counter()
    with Engine(model=model, quantization=mode, log_level="warning") as engine:
        nll, count, top1 = score_windows(engine, ids, args.window)
        halves_nll, halves_count = score_second_halves(engine, ids, args.window)
        outputs = greedy(engine, prompts, args.gen_tokens)
        loaded = engine.runner.model
        weights_mib = resident_weight_bytes(loaded) / 2**20
        # embedding rows mapped from the cache file: their size, and what scoring and generating paged in
        mapped_mib = mapped_weight_bytes(loaded) / 2**20
        paged_in_mib = (mapped_resident_bytes(loaded) or 0) / 2**20
    return {"mode": mode, "perplexity": math.exp(nll / count), "scored_tokens": count, "top1": top1,
            "llama_windows_perplexity": math.exp(halves_nll / halves_count),
            "outputs": outputs, "weights_mib": weights_mib, "mapped_mib": mapped_mib, "paged_in_mib": paged_in_mib,
            "seconds": time.perf_counter() - started}


def compare(result: dict, ref: dict) -> dict:
    same_top1 = sum(a == b for a, b in zip(result["top1"], ref["top1"]))
    prefixes = [matching_prefix(a, b) for a, b in zip(result["outputs"], ref["outputs"])]
    generated = sum(len(o) for o in ref["outputs"])
    ppl_ratio = result["perplexity"] / ref["perplexity"]
    return {"ppl_ratio": ppl_ratio, "within_tolerance": abs(ppl_ratio - 1) <= PPL_TOLERANCE,
            "top1_agreement": same_top1 / len(ref["top1"]),
            "greedy_agreement": sum(prefixes) / generated, "identical_continuations": sum(
                a == b for a, b in zip(result["outputs"], ref["outputs"])), "continuations": len(prefixes)}


def markdown(results: list[dict], comparisons: dict[str, dict], gen_tokens: int) -> str:
    lines = ["| mode | weights resident (MiB) | + mapped rows paged in / mapped (MiB) | perplexity | vs float32 "
             "| top-1 agreement | greedy agreement "
             f"| identical {gen_tokens}-token continuations | within 1% |",
             "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in results:
        c = comparisons[r["mode"]]
        mapped = f"{r['paged_in_mib']:.1f} / {r['mapped_mib']:.0f}" if r.get("mapped_mib") else "-"
        lines.append(f"| {r['mode']} | {r['weights_mib']:.0f} | {mapped} | {r['perplexity']:.3f} "
                     f"| {c['ppl_ratio'] - 1:+.2%} "
                     f"| {c['top1_agreement']:.1%} | {c['greedy_agreement']:.1%} "
                     f"| {c['identical_continuations']}/{c['continuations']} "
                     f"| {'yes' if c['within_tolerance'] else 'no'} |")
    return "\n".join(lines)


def against_llama_cpp(args, results: list[dict], prompts: list[list[int]]) -> dict:
    """llama.cpp's perplexity and greedy continuations on the model's GGUF beside each mode's."""
    if not (args.llama_perplexity or args.llama_server):
        return {}
    from radixlm.runtime.executor.cpu.int4 import gguf_source
    from radixlm.runtime.executor.loader import resolve_model

    gguf = gguf_source(resolve_model(args.model).folder)
    if gguf is None:
        raise SystemExit(f"--llama-perplexity / --llama-server: model {args.model} has no GGUF")
    peer: dict = {}
    if args.llama_perplexity:
        peer["perplexity"] = llama_perplexity(args.llama_perplexity, gguf, args.text, args.window, args.threads or 2)
    if args.llama_server:
        peer["outputs"] = llama_server_greedy(args.llama_server, gguf, prompts, args.gen_tokens)
    lines = [f"| mode | perplexity, llama.cpp's windows | vs llama.cpp ({peer.get('perplexity', float('nan')):.4f}) "
             f"| tokens equal to llama-server's before the first difference | identical continuations |",
             "|---|--:|--:|--:|--:|"]
    for r in results:
        ppl = r["llama_windows_perplexity"]
        ratio = f"{ppl / peer['perplexity'] - 1:+.2%}" if "perplexity" in peer else "-"
        same = "-"
        if "outputs" in peer:
            prefixes = [matching_prefix(a, b) for a, b in zip(r["outputs"], peer["outputs"])]
            same = (f"{sum(prefixes) / sum(len(o) for o in peer['outputs']):.1%} "
                    f"| {sum(a == b for a, b in zip(r['outputs'], peer['outputs']))}/{len(prefixes)}")
        lines.append(f"| {r['mode']} | {ppl:.4f} | {ratio} | {same if same != '-' else '- | -'} |")
    peer["table"] = "\n".join(lines)
    return peer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from radixlm.runtime.engine_args import QUANTIZATION_CHOICES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="none,int8,fp16", help="comma-separated; 'none' (float32) is the reference")
    p.add_argument("--text", default=str(TEXT), help="the text to score (default: the shipped one)")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="benchmarks/results/quality.json")
    p.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY"), help="llama-perplexity's path")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server's path")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in QUANTIZATION_CHOICES:
            p.error(f"unknown mode {mode!r}; choose from {', '.join(QUANTIZATION_CHOICES)}")
    if REFERENCE not in args.modes:
        args.modes.insert(0, REFERENCE)
    if args.window < 2 or args.prompts < 1 or args.prompt_tokens < 1 or args.gen_tokens < 1:
        p.error("--window must be >= 2 and --prompts, --prompt-tokens, --gen-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/quality.py", *(sys.argv[1:] if argv is None else argv)])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model).folder)
    ids = tokenizer(Path(args.text).read_text(encoding="utf-8")).input_ids
    step = max(1, (len(ids) - args.prompt_tokens) // args.prompts)
    prompts = [ids[i * step:i * step + args.prompt_tokens] for i in range(args.prompts)]
    results = []
    for mode in args.modes:
        results.append(run_mode(args.model, mode, ids, prompts, args))
        print(f"{mode}: perplexity {results[-1]['perplexity']:.3f} ({results[-1]['seconds']:.0f}s)", file=sys.stderr)
    ref = next(r for r in results if r["mode"] == REFERENCE)
    comparisons = {r["mode"]: compare(r, ref) for r in results}
    table = markdown(results, comparisons, args.gen_tokens)
    print(f"`{command}` ({len(ids)} text tokens, torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print(table)
    peer = against_llama_cpp(args, results, prompts)
    if peer:
        print("\n" + peer["table"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k not in ("top1", "outputs")} | comparisons[r["mode"]] for r in results]
    out.write_text(json.dumps({"command": command, "text_tokens": len(ids), "results": summary,
                               "llama_cpp": {k: v for k, v in peer.items() if k != "table"}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
