"""Streaming: print the model's text as it is generated.

Run it:  python examples/streaming.py

What it shows:
- `program.run(..., stream=True)` returns at once; the program keeps running in the background.
- `state.text_iter("story")` yields the variable piece by piece (token by token) until it is
  complete; the pieces concatenate to the final `state["story"]`.
  `state.text_iter()` (no name) streams the whole state text instead.
"""

from __future__ import annotations

import os

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "64"))


@rl.function
def tell_story(s, topic):
    s += rl.user(f"Tell a very short story about {topic}.")
    s += rl.assistant(rl.gen("story", max_tokens=MAX_TOKENS))


def main(backend=None) -> dict:
    backend = backend or rl.Engine(model="smollm2-135m")
    state = tell_story.run(topic="a robot who learns to paint", stream=True, backend=backend, temperature=0)
    pieces = []
    for piece in state.text_iter("story"):
        print(piece, end="", flush=True)   # appears while the model is still writing
        pieces.append(piece)
    print()
    return {"pieces": pieces, "story": state["story"]}


if __name__ == "__main__":
    main()
