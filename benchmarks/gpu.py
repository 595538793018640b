"""GPU benchmark: decode at batch 1 and 64, prefill, few-shot with the cache on
and off, JSON-constrained against unconstrained decoding, the GPU's busy share of a decode step,
transformers ``generate`` on the same model and the weight-bandwidth bound, all in one run; prints
a table naming the device and writes JSON.

    python benchmarks/gpu.py [--device auto|cuda|cpu] [--model 1b|tiny|tiny-random|PATH]
        [--attention-backend NAME] [--disable-cuda-graph] [--disable-overlap-schedule]
        [--cuda-graph-max-bs N] [--chunked-prefill-size N] [--dtype auto] [--scale S] [--repeats 2]
        [--threads N] [--no-hf] [--out benchmarks/results/gpu.json]

On a lent GPU (../shared/gpu/README.md): ``bash .gpu-carry/run.sh python benchmarks/gpu.py --model 1b``.
``1b`` and ``tiny`` are the random-weight models run.sh builds under $RADIXLM_GPU_MODELS;
``tiny-random`` builds a 2-layer random Llama with the built-in model's tokenizer here, so that
``--device cpu --model tiny-random`` runs every code path in seconds (CI does). Sizes are the
issue's at ``--scale 1``, the default on CUDA; on a CPU token counts are scaled by 1/16 (batch sizes
stay). Engine flags are passed only when given, so the script runs on ServerArgs without them.
Rows and methods: benchmarks/README.md, "GPU".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gpu_workloads as gw  # noqa: E402
import torch  # noqa: E402
import workloads as wl  # noqa: E402
from host_overhead import build_tiny_model  # noqa: E402
from offline import environment, fmt  # noqa: E402
from offline_systems import EngineSystem, HFSystem, tokenize  # noqa: E402
from tqdm import tqdm  # noqa: E402

CPU_SCALE = 1 / 16
GPU_MODELS_ENV = "RADIXLM_GPU_MODELS"
SERVER_ARGS = ("attention_backend", "disable_cuda_graph", "cuda_graph_max_bs", "disable_overlap_schedule",
               "disable_jump_forward", "chunked_prefill_size", "max_total_tokens", "max_running_requests",
               "grammar_backend")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--model", default="1b", help="1b | tiny ($RADIXLM_GPU_MODELS/<name>) | tiny-random | any --model")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU; every system")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--disable-jump-forward", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--grammar-backend", default=None, help="the JSON row's grammar backend (default: the runtime's)")
    p.add_argument("--scale", type=float, default=None,
                   help=f"token counts x S (default 1 on CUDA, {CPU_SCALE:g} on CPU)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement after a warm-up; fastest kept")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 on CPU, where the tiny model's ops are too small to split and split "
                        "ops stall on a busy machine; torch's own on CUDA)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--twin", default=None, metavar="DEVICE",
                   help="the GPU twin of DEVICE (benchmarks/data/twin_DEVICE.json, e.g. h200): on the CPU, the "
                        "real Engine with its forward a sleep as long as DEVICE's step, at the GPU's sizes "
                        "(benchmarks/twin.py)")
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.scale is not None and args.scale <= 0 or args.repeats < 1:
        p.error("--scale must be > 0 and --repeats >= 1")
    if args.twin:  # the device's sizes, on the CPU, its forward a stub: nothing device-bound is measured
        args.device, args.no_hf = "cpu", True
        args.scale = 1.0 if args.scale is None else args.scale
        args.model = "tiny-random" if args.model == "1b" else args.model
    return args


def model_folder(name: str, stack: contextlib.ExitStack, sizes: gw.Sizes) -> Path:
    from radixlm.runtime.executor.loader import resolve_model

    if name == "tiny-random":
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="radixlm-gpu-")))
        return build_tiny_model(folder, max_positions=sizes.max_positions())
    if name in ("1b", "tiny"):
        folder = Path(os.environ.get(GPU_MODELS_ENV, "/tmp/models")) / name
        if not (folder / "config.json").exists():
            raise SystemExit(f"{folder} has no model: ../shared/gpu/run.sh builds it (or set ${GPU_MODELS_ENV})")
        return folder
    return resolve_model(name).folder


def engine_kwargs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, sizes: gw.Sizes) -> dict:
    kw = {"log_level": "warning", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
          "max_total_tokens": sizes.pool_tokens(), "max_running_requests": max(64, *sizes.batches)}
    for flag in ("disable_cuda_graph", "disable_overlap_schedule", "disable_jump_forward"):  # only when asked for
        if getattr(args, flag):
            kw[flag] = True
    for key in ("attention_backend", "cuda_graph_max_bs", "chunked_prefill_size", "grammar_backend"):
        if getattr(args, key) is not None:
            kw[key] = getattr(args, key)
    return kw


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


# ------------------------------------------------------------------------------------------ the run


def twin_of(system: EngineSystem, args: argparse.Namespace) -> EngineSystem:
    """The system itself, or with `--twin`, its engine's forward replaced by the device's twin."""
    if args.twin:
        import twin

        system.twin = twin.install(system.engine, args.twin)
    return system


def run(args: argparse.Namespace, folder: Path, device: torch.device, sizes: gw.Sizes, bar: tqdm,
        report: dict) -> None:
    """Fills ``report`` (model, server_args, rows) as it measures: a crash leaves what was done. A row
    that raises is recorded under ``errors`` and the others still run (on a lent GPU's clock, the first
    run lost every row after a failing JSON row); the engine failing ends the run."""
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    tok = load_tokenizer(folder)
    kwargs = engine_kwargs(args, device, dtype, sizes)
    rows = report.setdefault("rows", {})
    errors = report.setdefault("errors", {})

    @contextlib.contextmanager
    def phase(label: str, isolated: bool = True) -> Iterator[None]:
        bar.set_description(label)
        try:
            yield
        except Exception as e:
            if not isolated:
                raise
            errors[label] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            release(device)
        finally:
            bar.update()

    decode_prompts = gw.prompts_of(tok, max(sizes.batches), sizes.prompt, seed=1)
    few = wl.few_shot(sizes.few_shot_reqs, sizes.few_shot_prefix, sizes.few_shot_new, seed=0,
                      count_tokens=lambda s: len(tokenize(tok, s)))
    with phase("engine", isolated=False):
        system = twin_of(EngineSystem("radixlm", str(folder), kwargs), args)
    with contextlib.closing(system):
        engine = system.engine
        params = list(engine.runner.model.parameters())
        report["model"] = model = {"params": sum(p.numel() for p in params),
                                   "dtype": str(engine.runner.dtype).removeprefix("torch."),
                                   "weight_bytes": sum(p.numel() * p.element_size() for p in params)}
        report["server_args"] = {k: v for k, v in engine.get_server_info().items() if k in SERVER_ARGS}
        report["attention"] = engine.runner.attn_backend.name  # what "auto" chose
        report["cuda_graphs"] = engine.runner.graph_runner is not None  # recorded: CUDA only
        for b in sizes.batches:
            with phase(f"decode batch {b}"):
                rows[f"decode_bs{b}"] = gw.decode_rate(system, decode_prompts[:b], sizes.new, args.repeats)
        with phase("GPU busy"):
            if not args.twin:
                rows["gpu_busy"] = gw.gpu_busy(engine, decode_prompts[: max(sizes.batches)], sizes.new, device)
                rows["gpu_busy"]["batch_1"] = gw.gpu_busy(engine, decode_prompts[:1], sizes.new, device)
        with phase("host syncs"):
            if not args.twin:
                rows["host_syncs"] = {str(b): gw.host_syncs(engine, decode_prompts[:b], sizes.new, device)
                                      for b in sorted({1, max(sizes.batches)})}
        with phase("prefill"):
            prompts = gw.prompts_of(tok, sizes.prefill_reqs, sizes.prefill_len, seed=2)
            res = gw.timed(system, gw.one_round("prefill", prompts, 1), args.repeats)
            rows["prefill"] = {"requests": res.requests, "prompt_tokens": res.prompt_tokens, "time_s": res.time_s,
                               "tok_s": res.prompt_tokens / res.time_s}
        few_on = None
        with phase("few-shot, cache on"):
            few_on = gw.timed(system, few, args.repeats)
        with phase("JSON vs unconstrained"):
            rows["json"] = gw.json_vs_plain(engine, tok, sizes.json_batch, sizes.json_new, args.repeats)
        del engine
    del system
    release(device)

    with phase("few-shot, cache off"):
        if few_on is None:
            raise RuntimeError("no cache-on run to compare with")
        with contextlib.closing(twin_of(EngineSystem("radixlm-nocache", str(folder), kwargs), args)) as off:
            few_off = gw.timed(off, few, args.repeats)
        del off
        release(device)
        rows["few_shot"] = {
            "requests": few_on.requests, "prompt_tokens": few_on.prompt_tokens,
            "output_tokens": few_on.output_tokens, "cache_on_s": few_on.time_s, "cache_off_s": few_off.time_s,
            "ratio": few_off.time_s / few_on.time_s, "hit_rate": few_on.hit_rate,
            "optimal_hit_rate": wl.optimal_hit_rate([tokenize(tok, r.prompt) for r in few.requests]),
            "same_outputs": gw.same_outputs(few_on, few_off)}
        if args.twin:  # what the twin's time is made of: modeled device time, the stand-in's overrun, the host
            rows["few_shot"]["twin"] = {"cache_on_device_s": few_on.device_s, "cache_on_overrun_s": few_on.overrun_s,
                                        "cache_off_device_s": few_off.device_s,
                                        "cache_off_overrun_s": few_off.overrun_s}

    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf: Any = None
        with phase("transformers, loading"):
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)  # (its stubs type .to oddly)
            hf.to(device).eval()
            hf.generation_config.eos_token_id = None  # ignore_eos, as offline.py does
        for b in sizes.batches:
            with phase(f"transformers, batch {b}"):
                if hf is None:
                    raise RuntimeError("transformers did not load")
                got = gw.decode_rate(HFSystem(f"hf-batch{b}", hf, tok, b), decode_prompts[:b], sizes.new,
                                     args.repeats)
                ours = rows.setdefault(f"decode_bs{b}", {"batch": b})  # bare if our row failed
                got["same_as_radixlm"] = gw.same_outputs(got, ours) if "outputs" in ours else None
                ours["transformers"] = got
        del hf
        release(device)

    if not args.twin:
        with phase("copy bandwidth"):
            bandwidth = gw.copy_bandwidth(device, sizes.copy_bytes)
            bound, bs1 = bandwidth / model["weight_bytes"], rows.get(f"decode_bs{min(sizes.batches)}", {}).get("tok_s")
            rows["bandwidth"] = {"copy_bytes": sizes.copy_bytes, "bytes_per_s": bandwidth, "bound_tok_s": bound,
                                 "weight_bytes": model["weight_bytes"], "decode_bs1_tok_s": bs1,
                                 "share_of_bound": ratio(bs1, bound)}
    for r in rows.values():  # output ids: compared above, not kept
        r.pop("outputs", None)
        r.get("transformers", {}).pop("outputs", None)


# ------------------------------------------------------------------------------------------ report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def markdown(data: dict) -> str:
    """The table; a row that failed or was not measured says so (with the error `run` recorded)."""
    s, rows, errors = data["sizes"], data["rows"], data.get("errors", {})
    lines = ["| row | RadixLM | baseline | ratio |", "|---|--:|--:|--:|"]

    def add(label: str, phases: list[str], cells) -> None:
        try:
            lines.append(cells())
        except (KeyError, TypeError):  # the row, or a figure of it, is missing
            why = "; ".join(f"{p}: {errors[p]}" for p in phases if p in errors) or "not measured"
            lines.append(f"| {label} | failed ({why.replace('|', '/')[:200]}) | — | — |")

    def decode(b: int) -> str:
        r = rows[f"decode_bs{b}"]
        hf = r.get("transformers")
        return (f"| decode, batch {b} ({r['prompt_tokens']:.0f}-token prompts, {s['new']} new) | "
                f"{fmt(r['tok_s'], '.1f')} tok/s | {fmt(hf and hf['tok_s'], '.1f')} tok/s (transformers generate) | "
                f"{fmt(ratio(r['tok_s'], hf and hf['tok_s']), '.2f', 'x')} |")

    def few_shot() -> str:
        f = rows["few_shot"]
        return (f"| few-shot, {f['requests']} x ({s['few_shot_prefix']} shared + ~"
                f"{f['prompt_tokens'] / f['requests'] - s['few_shot_prefix']:.0f}) -> {s['few_shot_new']} new | "
                f"{f['cache_on_s']:.2f} s (hit rate {fmt(f['hit_rate'], '.0%')}) | {f['cache_off_s']:.2f} s "
                f"(cache off) | {f['ratio']:.2f}x |")

    def json_row() -> str:
        j = rows["json"]
        return (f"| JSON-constrained, batch {j['batch']} ({j['valid']}/{j['batch']} valid) | "
                f"{j['json_tok_s']:.1f} tok/s | {j['plain_tok_s']:.1f} tok/s (unconstrained, same lengths) | "
                f"{j['ratio']:.2f}x |")

    def busy() -> str:
        g = rows["gpu_busy"]
        share = "n/a (no GPU)" if g["device"] == "cpu" else "n/a (no device activity recorded)"
        if g["share"] is not None:
            share = f"{g['share']:.0%}"
        one = g.get("batch_1")
        also = f"; batch 1: {one['share']:.0%} of {one['step_ms']:.2f} ms" if one and one["share"] is not None else ""
        return f"| GPU busy, batch-{g['batch']} decode step | {share} of a {g['step_ms']:.2f} ms step{also} | — | — |"

    def bandwidth() -> str:
        w = rows["bandwidth"]
        return (f"| weight-bandwidth bound, batch-1 decode | {fmt(w['decode_bs1_tok_s'], '.1f')} tok/s | "
                f"{w['bound_tok_s']:.0f} tok/s ({w['weight_bytes'] / 1e9:.3g} GB per step at "
                f"{w['bytes_per_s'] / 1e12:.3g} TB/s copy) | {fmt(w['share_of_bound'], '.1%')} |")

    for b in s["batches"]:
        add(f"decode, batch {b}", [f"decode batch {b}", f"transformers, batch {b}"], lambda b=b: decode(b))
    add(f"prefill, {s['prefill_reqs']} x {s['prefill_len']} tokens", ["prefill"],
        lambda: f"| prefill, {rows['prefill']['requests']} x {s['prefill_len']} tokens | "
                f"{rows['prefill']['tok_s']:.0f} tok/s | — | — |")
    add("few-shot", ["few-shot, cache on", "few-shot, cache off"], few_shot)
    if twin := rows.get("few_shot", {}).get("twin"):
        # the stand-in's overrun is time a GPU does not spend, and its steps hold up all that follows them
        on, off = (rows["few_shot"][f"cache_{k}_s"] - twin[f"cache_{k}_overrun_s"] for k in ("on", "off"))
        lines.append(f"| few-shot on the twin: device + stand-in overrun + host | "
                     f"{twin['cache_on_device_s']:.3f} + {twin['cache_on_overrun_s']:.3f} + "
                     f"{on - twin['cache_on_device_s']:.3f} s | {twin['cache_off_device_s']:.3f} + "
                     f"{twin['cache_off_overrun_s']:.3f} + {off - twin['cache_off_device_s']:.3f} s | "
                     f"{off / on:.2f}x without the overrun, "
                     f"{twin['cache_off_device_s'] / twin['cache_on_device_s']:.2f}x device alone |")
    add(f"JSON-constrained, batch {s['json_batch']}", ["JSON vs unconstrained"], json_row)
    if not data["config"].get("twin"):  # what only a device measures
        add("GPU busy", ["GPU busy"], busy)
        add("weight-bandwidth bound", ["copy bandwidth"], bandwidth)
    return "\n".join(lines)


def device_work(data: dict) -> str:
    """Per profiled decode step: the device work that takes longest, and where the device idles."""
    lines = []
    busy = data["rows"].get("gpu_busy") or {}
    for g in (busy, busy.get("batch_1") or {}):
        if not g.get("share"):
            continue
        gaps = g["gaps"]
        lines += [f"batch {g['batch']}: {g['step_ms'] * 1e3:.0f} us a step under the profiler; idle "
                  f"{gaps['small_us_per_step']:.0f} us in {gaps['small_per_step']:.1f} gaps under 20 us, "
                  f"{gaps['large_us_per_step']:.0f} us in {gaps['large_per_step']:.1f} longer ones "
                  f"(largest {', '.join(f'{x:.0f}' for x in gaps['largest_us'])} us)", "",
                  "| device work | calls / step | us / step |", "|---|--:|--:|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']:.1f} | {k['us_per_step']:.1f} |" for k in g["kernels"]]
        lines.append("")
    j = data["rows"].get("json") or {}
    if "forward_passes" in j:  # where a constrained run's time goes, against free text's
        lines += [f"JSON batch {j['batch']}: {j['wall_s']:.3f} s in {j['forward_passes']} forward passes "
                  f"({j['overlapped_steps']} overlapped), grammar work {j['grammar_s']:.3f} s, sampling "
                  f"{j['sample_s']:.3f} s, {j['jump_forward_tokens']} of {j['output_tokens']} tokens forced; "
                  f"unconstrained {j['plain_wall_s']:.3f} s in {j['plain_forward_passes']} passes", ""]
    for b, found in (data["rows"].get("host_syncs") or {}).items():
        if found["sites"] is not None:
            sites = ", ".join(f"{site} x{n}" for site, n in found["sites"].items()) or "none"
            lines += [f"batch {b}: ops that blocked the host on the device in {found['new_tokens']} decode steps: "
                      f"{sites}", ""]
    return "\n".join(lines)


def header(data: dict) -> str:
    m, a = data["model"], data["server_args"]
    twin = data["config"].get("twin")
    device = f"the {twin} twin (benchmarks/twin.py) on {data['device_name']}" if twin else data["device_name"]
    return (f"device: {device}; torch {torch.__version__}; model {data['config']['model']} "
            f"({m['params'] / 1e6:.0f}M params, {m['dtype']}, {m['weight_bytes'] / 1e9:.3g} GB); "
            f"attention {data['attention']}, CUDA graphs {'on' if data['cuda_graphs'] else 'off'}, "
            f"overlap {'off' if a['disable_overlap_schedule'] else 'on'}, grammars {a.get('grammar_backend', '?')}; "
            f"scale {data['scale']:g}")


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    from radixlm.runtime.executor.model_runner import resolve_device

    device = resolve_device(args.device)
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else CPU_SCALE)
    sizes = gw.Sizes().scaled(scale)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    phases = 8 + len(sizes.batches) * (1 if args.no_hf else 2) + (0 if args.no_hf else 1)  # run()'s phases
    bar = tqdm(total=phases, unit="phase", disable=args.no_progress, dynamic_ncols=True)
    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        if threads > 0:
            stack.callback(torch.set_num_threads, torch.get_num_threads())  # restored for a caller (tests)
            torch.set_num_threads(threads)
        data = {"command": command, "device_name": device_name(device), "scale": scale, "config": dict(vars(args)),
                "sizes": dataclasses.asdict(sizes), "environment": environment(threads or torch.get_num_threads())}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            run(args, model_folder(args.model, stack, sizes), device, sizes, bar, data)
        except BaseException:  # on a lent GPU's clock: keep what was measured
            out.write_text(json.dumps({**data, "complete": False}, indent=2, default=str) + "\n")
            raise
    data.update(complete=True, wall_s=time.perf_counter() - started)
    data["header"], data["table_markdown"] = header(data), markdown(data)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\n{data['header']}\n\n{data['table_markdown']}\n")
    if work := device_work(data):
        print(work)
    print(f"command: {command}\nwall time {data['wall_s']:.0f}s (including model loading)\nsaved {out}")
    return data


if __name__ == "__main__":
    main()
