"""A multi-turn chat: roles render through the model's own chat template.

Run it:  python examples/multi_turn_chat.py

What it shows:
- `s += rl.system(...)`, `rl.user(...)`, `rl.assistant(rl.gen(...))` add chat messages; the
  text between them is exactly what the model's chat template produces (`s.messages()` gives
  the messages back as dicts).
- `with s.user():` is the block form of the same thing.
- A gen inside an assistant message stops at the end-of-turn marker by itself.
- Each turn resends the whole conversation, but the radix cache already holds everything up to
  the previous answer, so only the new user message is computed (see cached_tokens).
"""

from __future__ import annotations

import os

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "48"))


@rl.function
def chat(s, questions):
    s += rl.system("You are a friendly assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        with s.user():          # block form: everything appended inside is the user's message
            s += question
        s += rl.assistant(rl.gen(f"answer_{i}", max_tokens=MAX_TOKENS))


QUESTIONS = [
    "What is a good name for a pet goldfish?",
    "Why is that a good name?",
    "Suggest one more name.",
]


def main(backend=None):
    backend = backend or rl.Engine(model="smollm2-135m")
    state = chat.run(questions=QUESTIONS, backend=backend, temperature=0)
    for i, question in enumerate(QUESTIONS):
        meta = state.get_meta_info(f"answer_{i}")
        print(f"USER: {question}")
        print(f"ASSISTANT: {state[f'answer_{i}']}")
        print(f"   ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens came from the cache)")
    print("\nThe conversation as messages:", state.messages())
    return state


if __name__ == "__main__":
    main()
