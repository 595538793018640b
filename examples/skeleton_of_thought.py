"""Skeleton-of-thought: outline an answer, then expand every point in parallel with `fork`.

Run it:  python examples/skeleton_of_thought.py

What it shows:
- `forks = s.fork(n)` makes n copies of the state; each branch runs on its own thread, so their
  gen calls reach the runtime together and are decoded as one batch.
- The branches share everything before the fork point; the runtime caches that prefix once and
  every branch reuses it (cached_tokens in the branch's meta info).
- `forks.join()` waits for the branches; a variable set in the branches becomes, in the parent,
  the list of the branches' values.
"""

from __future__ import annotations

import os

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "32"))
NUM_POINTS = 3


@rl.function
def skeleton_of_thought(s, question):
    s += rl.system("You are a helpful assistant who answers with short, clear points.")
    s += rl.user(f"{question} Give {NUM_POINTS} key points as a numbered list, a few words each.")
    with s.assistant():
        # 1. the skeleton: one short line per point (we write the numbers, the model the rest)
        for i in range(NUM_POINTS):
            s += f"{i + 1}." + rl.gen(f"point_{i}", max_tokens=12, stop="\n") + "\n"

    # 2. expand every point in its own branch, all at once
    forks = s.fork(NUM_POINTS)
    for i, branch in enumerate(forks):
        point = s[f"point_{i}"].strip()   # reading a variable waits for its gen
        branch += rl.user(f"Explain this point in two sentences: {point}")
        branch += rl.assistant(rl.gen("expansion", max_tokens=MAX_TOKENS))
    forks.join()   # s["expansion"] is now the list of the branches' answers


def main(backend=None) -> dict:
    backend = backend or rl.Engine(model="smollm2-135m")
    state = skeleton_of_thought.run(question="How can I sleep better?", backend=backend, temperature=0)
    points = [state[f"point_{i}"].strip() for i in range(NUM_POINTS)]
    expansions = state["expansion"]
    cached = [meta["cached_tokens"] for meta in state.get_meta_info("expansion")]
    for i, (point, text) in enumerate(zip(points, expansions)):
        print(f"{i + 1}. {point}\n   {text.strip()}\n")
    print("prompt tokens each branch took from the cache:", cached)
    return {"points": points, "expansions": expansions, "cached_tokens": cached}


if __name__ == "__main__":
    main()
