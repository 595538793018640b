"""Where the shared-system trace's first wave spends its time: each step of the engine, and each TTFT.

    python benchmarks/first_wave.py [--clients 8] [--system-tokens 1700] [--quantization int8]
        [--threads 2] [--max-new-tokens 8] [--int8-batch-packing auto|off] [--enable-torch-compile]

The first turn of every client of `serving.py --trace shared-system` (the same prompts), sent at once
to an in-process Engine, streamed. The runner's forward is timed around each step, so the table shows
which steps a client waited on before its first token: the TTFT p99 of the trace is this wave's
slowest client. The cache starts cold, as in the trace.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import multi_tenant  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from radixlm.runtime import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1700)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8-batch-packing", default="auto", help="off: one packing of the int8 weights")
    p.add_argument("--enable-torch-compile", action="store_true", help="the compiled forward (compiled_forward.py)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, quantization=args.quantization, log_level="warning",
                    int8_batch_packing=args.int8_batch_packing, enable_torch_compile=args.enable_torch_compile)
    tok = engine.tokenizer
    trace = multi_tenant.build_trace(1, args.clients, 1, args.system_tokens, args.max_new_tokens,
                                     lambda text: len(tok.encode(text)),
                                     lambda msgs: tok.apply_chat_template(msgs, tokenize=False,
                                                                          add_generation_prompt=True))
    prompts = [session[0].prompt for session in trace]
    runner, forward, steps = engine.runner, engine.runner.forward, []

    def timed(batch):
        start = time.perf_counter()
        out = forward(batch)
        steps.append((start - t0, time.perf_counter() - start, batch.mode.name, list(batch.extend_lens_host)))
        return out

    runner.forward = timed
    ttft: dict[int, float] = {}
    bar = tqdm(total=len(prompts), desc="first tokens")

    def client(i: int) -> None:
        for _ in engine.generate(prompts[i], {"max_new_tokens": args.max_new_tokens, "temperature": 0}, stream=True):
            if i not in ttft:
                ttft[i] = time.perf_counter() - t0
                bar.update()

    t0 = time.perf_counter()  # read by timed() and client()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    del runner.forward
    engine.shutdown()

    last = max(ttft.values())
    lengths = [len(tok.encode(prompt)) for prompt in prompts]
    mode = args.quantization + (", compiled" if args.enable_torch_compile else "")
    print(f"\n{mode}, {torch.get_num_threads()} thread(s), {len(prompts)} clients, prompts of "
          f"{min(lengths)}-{max(lengths)} tokens\n")
    print("| step starts (s) | takes (s) | mode | new tokens per request |\n|--:|--:|---|---|")
    for start, took, mode, lens in steps:
        if start > last:
            break
        shown = lens if len(set(lens)) > 1 or len(lens) == 1 else f"{len(lens)} x {lens[0]}"
        print(f"| {start:.3f} | {took:.3f} | {mode} | {shown} |")
    print("\nTTFT (s): " + ", ".join(f"{v:.3f}" for v in sorted(ttft.values())))


if __name__ == "__main__":
    main()
