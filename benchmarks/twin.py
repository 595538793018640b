"""The GPU twin: the real Engine (scheduler, radix cache, grammars, sampler, outputs) with the model's
forward replaced by a stub that returns seeded random logits and sleeps, GIL released, as long as a
cost model says the device would take for that batch. Whatever host work does not hide behind the
sleep shows up as it would beside a GPU, so design choices for the GPU (overlap, masks, admission,
tokenization) are made here and confirmed on a lent device.

The cost model is fitted from the project's own H200 figures and kept with them in
``benchmarks/data/twin_h200.json`` (its ``how`` and ``fitted_from`` say how). ``gpu.py --twin h200``
runs every row of the GPU benchmark on it; ``install(engine, "h200")`` puts it under any Engine.

Sampling (and applying the masks) runs on the CPU here, where on a GPU it is device work inside the
step: the twin times it and shortens the next step's sleep by as much, so a step's launch lasts its
device time and the host's own work is what shows. Where the copy of a step's logits and its sampling
take longer than the step's device time (wide decode batches on a host with little memory bandwidth:
both pass over [rows, vocab] floats), the step overruns; `overrun_s` adds that up, and `gpu.py`
reports it beside the rows it touches. Not modelled: the attention backend's per-step
planning (the stub stands for the whole forward), the unpacking of the masks (device work on a GPU,
host work here), and a GPU host's cores (the masks of a batch are filled on every core: a 16-core
host fills them faster than a 2-core twin).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

DATA = Path(__file__).resolve().parent / "data"
BANK_ROWS = 1024  # random logit rows; a row's logits are the bank row its (token, position) picks
BUFFERS = 4  # logits buffers used in turn


@dataclass(frozen=True, slots=True)
class CostModel:
    """Device seconds of one step, from its rows, new tokens and context (see the JSON's `how`)."""

    decode_base: float
    decode_per_row: float
    decode_per_context_token: float
    extend_base: float
    extend_per_token: float
    extend_per_pair: float
    graphed_decode_max_rows: int

    @classmethod
    def load(cls, name: str) -> CostModel:
        data = json.loads((DATA / f"twin_{name}.json").read_text())
        d, e = data["decode_s"], data["extend_s"]
        return cls(d["base"], d["per_row"], d["per_context_token"], e["base"], e["per_token"], e["per_pair"],
                   data["graphed_decode_max_rows"])

    def step_seconds(self, mode: ForwardMode, seq_lens: list[int], extend_lens: list[int], shared: int = 0) -> float:
        """`shared`: leading keys every row holds in the same slots, which a decode's cascade pass
        reads once for the batch (the triton backend's), where the fit's rows each read their own."""
        tokens = sum(extend_lens)
        if mode is ForwardMode.DECODE and len(seq_lens) <= self.graphed_decode_max_rows:
            context = sum(seq_lens) - shared * (len(seq_lens) - 1)
            return self.decode_base + self.decode_per_row * len(seq_lens) + self.decode_per_context_token * context
        # an extend (or a decode too large for a graph): every new token against its prefix and itself
        pairs = sum(n * (s - n) + n * (n + 1) // 2 for s, n in zip(seq_lens, extend_lens))
        return self.extend_base + self.extend_per_token * tokens + self.extend_per_pair * pairs


class TwinForward:
    """Stands in for `ModelRunner.forward`: random logits [rows, vocab] after sleeping the cost model's
    time for the batch. A row's logits depend on its last token and position only (a seeded bank row
    picked by them), as a model's depend on the sequence: the cache, the batch and overlap change no
    answer on the twin either."""

    def __init__(self, runner, cost: CostModel, seed: int = 0):
        self.cost = cost
        self.vocab = runner.vocab_size
        self.device = runner.device
        self.seed = seed
        self.steps = 0
        self.device_s = 0.0  # the device time of every step, in all
        # how far steps ran past their device time because the stand-in's own work (the logits' copy
        # and the CPU sampling, both memory-bound) took longer: time a GPU would not spend, in all
        self.overrun_s = 0.0
        self.sampling_s = 0.0  # CPU time of the last step's sampling: device work on a GPU, so not slept
        gen = torch.Generator().manual_seed(seed)
        self._bank = torch.randn(BANK_ROWS, self.vocab, generator=gen).to(self.device)
        self._buffers = [torch.empty(0, self.vocab, device=self.device)] * BUFFERS

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The rows' bank rows, copied into one of a few reused buffers: a fresh [rows, vocab] tensor
        a step would fault its pages in every time (milliseconds at batch 64), host work a GPU's
        logits never cost. A buffer is reused only after BUFFERS - 1 later steps, by when nothing
        reads it (a step's logits are sampled, and read by its resolve, before the next but one)."""
        rows = batch.logits_indices
        key = (batch.input_ids[rows] * 1_000_003 + batch.positions[rows] * 7919 + self.seed) % BANK_ROWS
        n = key.numel()
        if self._buffers[0].shape[0] < n:
            self._buffers = [torch.empty(n, self.vocab, device=self.device) for _ in range(BUFFERS)]
        out = self._buffers[self.steps % BUFFERS][:n]
        return torch.index_select(self._bank, 0, key, out=out)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        seconds = self.cost.step_seconds(batch.mode, batch.seq_lens_host, batch.extend_lens_host,
                                         batch.shared_prefix_len)
        self.device_s += seconds
        start = time.perf_counter()
        out = self._logits(batch)
        self.steps += 1
        left = seconds - self.sampling_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)  # releases the GIL, like waiting on the device
        else:
            self.overrun_s -= left
        return out


def install(engine, name: str = "h200", seed: int = 0) -> TwinForward:
    """Replaces `engine`'s model forward with the twin of device `name` (benchmarks/data/twin_<name>.json),
    and times its sampling (see the module's docstring). One twin a process: the sampling hook is global."""
    from host_overhead import exact_sleeps

    from radixlm.runtime.executor.compute_thread import hand_back_gil_promptly
    from radixlm.runtime.sampling import step

    exact_sleeps()
    hand_back_gil_promptly()  # what a runner on a GPU does
    twin = TwinForward(engine.runner, CostModel.load(name), seed)
    sample = getattr(step._sample, "untimed", step._sample)

    def timed_sample(*args, **kwargs):
        start = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            twin.sampling_s = time.perf_counter() - start

    timed_sample.untimed = sample
    step._sample = timed_sample

    def forward(batch: ForwardBatch) -> torch.Tensor:
        exact_sleeps()  # per thread: the compute thread's sleeps end on time too
        return twin(batch)

    engine.runner.forward = forward  # the instance attribute shadows the method
    engine.runner.graph_runner = None
    return twin
