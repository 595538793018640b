"""Host time per call of an agent whose history grows: what the server and the Engine spend tokenizing a
prompt that resends a whole conversation, with the tokenization cache (runtime/request/token_cache.py)
against tokenizing the whole text, as the history grows towards a long context.

    python benchmarks/long_history.py [--model smollm2-135m] [--turn-tokens 200] [--max-tokens 50000]
        [--report 1000,5000,10000,25000,50000] [--repeats 5] [--json PATH]

Each turn appends ~`--turn-tokens` tokens of chat-rendered text (a user question and an assistant answer
with a tool call) to the history and tokenizes the history through the cache, as the server's and the
Engine's request builder does. At each report point: the median of the last 8 calls (cached), the
tokenizer on the turn's new text alone (the floor), and the tokenizer on the whole history (what every
call cost without the cache); the ids there are checked against the whole-text ids. Nothing is
downloaded: the built-in model's tokenizer is used.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def turn_text(i: int) -> str:
    return (f"<|im_start|>user\nStep {i}: what is the weather in city number {i}, and should I pack an umbrella "
            f"for the trip on day {i % 7}?<|im_end|>\n<|im_start|>assistant\nLet me check. <tool_call>\n"
            f'{{"name": "get_weather", "arguments": {{"city": "City {i}", "day": {i % 7}}}}}\n</tool_call>\n'
            f"The forecast for city {i} says {10 + i % 20} degrees with a {i % 100}% chance of rain, so "
            f"{'take' if i % 2 else 'skip'} the umbrella.<|im_end|>\n")


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=50_000)
    p.add_argument("--turn-tokens", type=int, default=200, help="about how many tokens a turn adds")
    p.add_argument("--report", default="1000,5000,10000,25000,50000")
    p.add_argument("--repeats", type=int, default=5, help="whole-text tokenizations timed at each report point")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model
    from radixlm.runtime.request.token_cache import PrefixTokenizer

    tok = load_tokenizer(resolve_model(args.model).folder)
    gc.freeze()  # as the server's processes do after start-up: collections walk only new objects
    cache = PrefixTokenizer(tok)
    points = sorted(int(x) for x in args.report.split(","))
    history = "<|im_start|>system\nYou are an agent with a weather tool.<|im_end|>\n"
    rows, calls, i = [], [], 0
    per_turn = max(1, round(args.turn_tokens / 100))
    while points:
        new = "".join(turn_text(i * 1000 + k) for k in range(per_turn))
        i += 1
        history += new
        start = time.perf_counter()
        ids = cache.encode(history)  # the call an agent's turn makes: its history, one turn longer
        cached = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        alone = len(tok(new).input_ids)
        calls.append((cached, (time.perf_counter() - start) * 1e3))
        if len(ids) < points[0] and len(ids) < args.max_tokens:
            continue
        points.pop(0)
        assert ids == tok(history).input_ids, f"the cache's ids differ from whole-text tokenization at {len(ids)}"
        recent = calls[-8:]  # the calls just before this point
        row = {"tokens": len(ids), "turn_tokens": alone, "cached_ms": statistics.median(c for c, _ in recent),
               "turn_alone_ms": statistics.median(a for _, a in recent),
               "whole_ms": median_ms(lambda h=history: tok(h), args.repeats)}
        row["whole_over_cached"] = row["whole_ms"] / row["cached_ms"]
        row["cached_over_alone"] = row["cached_ms"] / row["turn_alone_ms"]
        rows.append(row)
        if len(ids) >= args.max_tokens:
            break
    print("| history (tokens) | new tokens | cached call (ms) | whole text (ms) | the turn alone (ms) | whole / cached "
          "| cached / alone |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['turn_tokens']} | {r['cached_ms']:.2f} | {r['whole_ms']:.1f} | "
              f"{r['turn_alone_ms']:.2f} | {r['whole_over_cached']:.0f}x | {r['cached_over_alone']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "argv": argv}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
