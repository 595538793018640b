"""The systems the offline benchmark compares: RadixLM Engines and transformers baselines.

Each system's ``run(workload, positions, bar)`` generates the workload's rounds in order and returns
a RunResult with the wall and CPU time of generation only (loading and warm-up are not timed).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import workloads as wl
from tqdm import tqdm

# name -> Engine options on top of the run's; radixlm-torch-gemm: torch's own CPU kernels (MKL
# matmuls, SDPA attention) instead of oneDNN, to measure what models/linear.py buys;
# radixlm-no-overlap: every step resolved before the next is scheduled; radixlm-int8: int8 weights
# and per-token int8 activations on the CPU (--quantization int8, cpu/int8.py);
# radixlm-int8-packing-off: the same with one packing of the weights (--int8-batch-packing off);
# radixlm-int8-compiled: int8 with the forward compiled by torch.compile (--enable-torch-compile);
# radixlm-fp16[-compiled]: fp16 weights, float32 activations (--quantization fp16, cpu/fp16.py)
ENGINE_SYSTEMS = {"radixlm": {}, "radixlm-nocache": {"disable_radix_cache": True},
                  "radixlm-torch-gemm": {"cpu_gemm": "torch"}, "radixlm-no-overlap": {"disable_overlap_schedule": True},
                  "radixlm-int8": {"quantization": "int8"},
                  "radixlm-int8-packing-off": {"quantization": "int8", "int8_batch_packing": "off"},
                  "radixlm-int8-compiled": {"quantization": "int8", "enable_torch_compile": True},
                  "radixlm-fp16": {"quantization": "fp16"},
                  "radixlm-fp16-compiled": {"quantization": "fp16", "enable_torch_compile": True}}


@dataclass
class RunResult:
    workload: str
    system: str
    requests: int  # requests run
    total_requests: int  # requests in the workload
    prompt_tokens: int
    output_tokens: int
    time_s: float  # wall time of generation
    cpu_s: float = 0.0  # CPU time of this process (all threads) during generation
    load_average: tuple | None = None  # 1-minute load average before and after the run
    forward_passes: int | None = None
    cached_tokens: int | None = None
    cache_stats: dict | None = None  # delta of the engine's radix-cache stats over the run
    optimal_hit_rate: float | None = None  # of the requests this system ran
    # on the GPU twin (benchmarks/twin.py): the run's modeled device time, and how far the stand-in's
    # own work ran past it
    device_s: float | None = None
    overrun_s: float | None = None
    outputs: dict = field(default_factory=dict, repr=False)  # request position -> output ids

    @property
    def sampled(self) -> bool:
        return self.requests < self.total_requests

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.time_s if self.time_s > 0 else float("inf")

    @property
    def cpu_tok_s(self) -> float:
        return self.output_tokens / self.cpu_s if self.cpu_s > 0 else float("inf")

    @property
    def hit_rate(self) -> float | None:
        if self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d.update(sampled=self.sampled, output_tok_s=self.tok_s, output_tok_per_cpu_s=self.cpu_tok_s,
                 hit_rate=self.hit_rate)
        if self.hit_rate is not None and self.optimal_hit_rate:
            d["hit_over_optimal"] = self.hit_rate / self.optimal_hit_rate
        return d


# ------------------------------------------------------------------------------------------ systems


class EngineSystem:
    """One RadixLM Engine, created once and reused across workloads (cache flushed in between)."""

    def __init__(self, name: str, model: str, engine_kwargs: dict):
        from radixlm.runtime import Engine

        self.name = name
        self.twin = None  # the GPU twin under the engine's forward, once installed (gpu.py --twin)
        self.engine = Engine(model=model, **{**engine_kwargs, **ENGINE_SYSTEMS[name]})
        self.engine.generate(["Warm-up: count to three."], wl.sampling_params(wl.Request("", 4, 0, 0)))
        self._flush()

    def _flush(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError(f"{self.name}: flush_cache refused (requests still running)")

    def run(self, work: wl.Workload, positions: dict[int, int], bar: tqdm) -> RunResult:
        self._flush()
        before = self.engine.get_server_info()
        res = RunResult(work.name, self.name, 0, 0, 0, 0, 0.0, cached_tokens=0)
        twin_before = (self.twin.device_s, self.twin.overrun_s) if self.twin is not None else None
        for rnd in work.rounds:
            prompts = [r.prompt for r in rnd]
            params = [wl.sampling_params(r) for r in rnd]
            t0, c0 = time.perf_counter(), time.process_time()
            outs = self.engine.generate(prompts, params)
            res.time_s += time.perf_counter() - t0
            res.cpu_s += time.process_time() - c0
            for req, out in zip(rnd, outs):
                meta = out["meta_info"]
                res.prompt_tokens += meta["prompt_tokens"]
                res.output_tokens += meta["completion_tokens"]
                res.cached_tokens += meta["cached_tokens"]
                res.outputs[positions[id(req)]] = list(out["output_ids"])
            res.requests += len(rnd)
            bar.update(len(rnd))
        after = self.engine.get_server_info()
        if twin_before is not None:
            res.device_s, res.overrun_s = (self.twin.device_s - twin_before[0], self.twin.overrun_s - twin_before[1])
        res.forward_passes = after["forward_passes"] - before["forward_passes"]
        res.cache_stats = {k: after["cache"][k] - before["cache"].get(k, 0)
                           for k in ("hit_tokens", "query_tokens")}
        return res

    def close(self) -> None:
        self.engine.shutdown()


class HFSystem:
    """transformers ``generate``: one request at a time (batch_size 1) or left-padded batches."""

    def __init__(self, name: str, model, tokenizer, batch_size: int):
        self.name = name
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._generate([wl.Request("Warm-up: count to three.", 4, 0, 0)])

    def _generate(self, reqs: list[wl.Request]) -> list[list[int]]:
        from transformers import GenerationConfig

        n = reqs[0].max_new_tokens
        assert all(r.max_new_tokens == n for r in reqs), "a batch shares max_new_tokens"
        # EOS is not a stop token (ignore_eos): every row generates exactly n tokens
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, use_cache=True, eos_token_id=None,
                               pad_token_id=self.pad_id)
        ids = [tokenize(self.tok, r.prompt) for r in reqs]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):  # left padding
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.model.device),
                                      attention_mask=mask.to(self.model.device), generation_config=cfg)
        new = out[:, width:].tolist()
        assert all(len(row) == n for row in new), "transformers stopped early"
        return new

    def run(self, work: wl.Workload, positions: dict[int, int], bar: tqdm) -> RunResult:
        res = RunResult(work.name, self.name, 0, 0, 0, 0, 0.0)
        for rnd in work.rounds:
            for i in range(0, len(rnd), self.batch_size):
                chunk = rnd[i : i + self.batch_size]
                t0, c0 = time.perf_counter(), time.process_time()
                outs = self._generate(chunk)
                res.time_s += time.perf_counter() - t0
                res.cpu_s += time.process_time() - c0
                for req, ids in zip(chunk, outs):
                    res.prompt_tokens += len(tokenize(self.tok, req.prompt))
                    res.output_tokens += len(ids)
                    res.outputs[positions[id(req)]] = ids
                res.requests += len(chunk)
                bar.update(len(chunk))
        return res


class HFForwardSystem(HFSystem):
    """A plain transformers forward over each prompt (all positions' logits, as `model(input_ids)`
    computes them); the next token is the argmax at the last position. Only for workloads that ask
    for exactly one new token (prefill)."""

    def __init__(self, name: str, model, tokenizer):
        super().__init__(name, model, tokenizer, batch_size=1)

    @staticmethod
    def supports(work: wl.Workload) -> bool:
        return all(r.max_new_tokens == 1 for r in work.requests)

    def _generate(self, reqs: list[wl.Request]) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for r in reqs:
                ids = torch.tensor([tokenize(self.tok, r.prompt)], device=self.model.device)
                out.append([int(self.model(ids).logits[0, -1].argmax())])
        return out


def tokenize(tok, text: str) -> list[int]:
    """Token ids as the Engine computes them (a BOS written by a chat template is not doubled)."""
    ids = tok(text).input_ids
    if tok.bos_token and text.startswith(tok.bos_token) and len(ids) > 1 and ids[0] == ids[1] == tok.bos_token_id:
        ids = ids[1:]
    return ids
