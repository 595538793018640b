"""Few-shot question answering: many questions share one prompt of worked examples.

Run it:  python examples/few_shot_qa.py

What it shows:
- `@rl.function` turns a Python function into a program; `s += ...` appends text or a `gen`.
- `gen(..., stop="\\n")` ends the answer at the end of the line.
- `run_batch` runs one program per question concurrently. Every prompt starts with the same
  examples, so the runtime's radix cache computes them once: `cached_tokens` in the meta info
  shows how many prompt tokens each answer got for free.
"""

from __future__ import annotations

import os

import radixlm.lang as rl

# Keeps the example fast in tests (RADIXLM_EXAMPLE_MAX_TOKENS=8); answers are short anyway.
MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "16"))

# The shared few-shot prefix: a pattern the model continues.
EXAMPLES = """Answer each question with a few words.

Question: What is the capital of Germany?
Answer: Berlin

Question: How many days are in a week?
Answer: Seven

Question: What color is grass?
Answer: Green

Question: What is the largest ocean on Earth?
Answer: The Pacific Ocean
"""

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a dog have?",
    "What is the opposite of hot?",
    "What do bees make?",
]


@rl.function
def few_shot_qa(s, question):
    s += EXAMPLES
    s += "\nQuestion: " + question + "\n"
    s += "Answer:" + rl.gen("answer", max_tokens=MAX_TOKENS, stop="\n")


def main(backend=None) -> list[dict]:
    # Any backend works: the in-process Engine here, or rl.RuntimeEndpoint("http://...").
    backend = backend or rl.Engine(model="smollm2-135m")
    states = few_shot_qa.run_batch(
        [{"question": q} for q in QUESTIONS], backend=backend, temperature=0
    )
    results = []
    for question, state in zip(QUESTIONS, states):
        meta = state.get_meta_info("answer")
        results.append({"question": question, "answer": state["answer"].strip(),
                        "cached_tokens": meta["cached_tokens"], "prompt_tokens": meta["prompt_tokens"]})
        print(f"{question:40s} -> {state['answer'].strip():20s} "
              f"({meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens from the cache)")
    return results


if __name__ == "__main__":
    main()
