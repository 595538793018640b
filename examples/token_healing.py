"""Token healing: prompts that end in a space or mid-word, with and without healing.

Run it:  python examples/token_healing.py

What it shows:
- A prompt ending in a space ("The capital of France is ") leaves the model after a bare space
  token, which it rarely saw there: greedy SmolLM2 writes "21st-century Paris...".
  `gen(..., token_healing=True)` backs off that token and lets the first generated token spell it
  out: " Paris" is now the natural choice, and the output ("Paris...") leaves the space out.
- Mid-word prompts heal too ("My favourite colour is bl" -> "ue").
- With a constraint: `gen_int` after "A week has " (SGLang's int regex, which stops at a space)
  becomes a short number, because a token like " hours" may now end the integer at its space.
Healing is off by default, so programs give SGLang's outputs unless they ask for it.
"""

from __future__ import annotations

import os

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "12"))
PROMPTS = ["The capital of France is ", "My favourite colour is bl"]


@rl.function
def complete(s, prompt, healing):
    s += prompt + rl.gen("text", max_tokens=MAX_TOKENS, token_healing=healing)


@rl.function
def days(s, healing):
    s += "A week has " + rl.gen_int("n", max_tokens=16, token_healing=healing)


def main(backend=None) -> list[dict]:
    backend = backend or rl.Engine(model="smollm2-135m")
    rows = []
    for prompt in PROMPTS:
        plain, healed = (complete.run(prompt=prompt, healing=h, backend=backend, temperature=0)["text"]
                         for h in (False, True))
        rows.append({"prompt": prompt, "plain": plain, "healed": healed})
    plain, healed = (days.run(healing=h, backend=backend, temperature=0)["n"] for h in (False, True))
    rows.append({"prompt": "A week has <gen_int>", "plain": plain, "healed": healed})
    for row in rows:
        print(f"{row['prompt']!r}\n  plain:  {row['plain']!r}\n  healed: {row['healed']!r}")
    return rows


if __name__ == "__main__":
    main()
