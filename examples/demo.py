"""The main job on the built-in model: answer a handful of chat prompts in one batch, twice,
and show what the radix cache saved the second time.

    python examples/demo.py
"""

from __future__ import annotations

import time

from radixlm.runtime import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python.",
    "Explain what a radix tree is in one sentence.",
    "Write a haiku about autumn.",
    "What is 12 times 7?",
    "Name two planets with rings.",
]


def main() -> None:
    with Engine(model="smollm2-135m") as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = {"temperature": 0, "max_new_tokens": 48}
        for label in ("cold cache", "warm cache"):
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outputs)
            cached = sum(o["meta_info"]["cached_tokens"] for o in outputs)
            generated = sum(o["meta_info"]["completion_tokens"] for o in outputs)
            print(f"\n== {label}: {len(prompts)} prompts in one batch, {elapsed:.2f}s, "
                  f"{generated / elapsed:.0f} output tok/s, cache hit {cached}/{prompt_tokens} "
                  f"prompt tokens ({cached / prompt_tokens:.0%})")
            if label == "cold cache":
                for q, o in zip(QUESTIONS, outputs):
                    print(f"\nQ: {q}\nA: {o['text'].strip()}")
        stats = engine.get_server_info()["cache"]
        print(f"\nradix cache overall: {stats['hit_tokens']}/{stats['query_tokens']} tokens hit "
              f"({stats['hit_rate']:.0%}), {stats['num_nodes']} nodes")


if __name__ == "__main__":
    main()
