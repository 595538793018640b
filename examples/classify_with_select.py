"""Classification with `select`: the model picks one label from a fixed list.

Run it:  python examples/classify_with_select.py

What it shows:
- `rl.select("label", choices=[...])` never produces anything outside the list. It scores every
  choice in one batched, prefill-only request over the (cached) prompt and appends the best.
- The scores are in the meta info: `s.get_meta_info("label")["normalized_prompt_logprobs"]`, one
  per choice, in the order of `choices` (mean log-probability of the choice's tokens).
"""

from __future__ import annotations

import radixlm.lang as rl

LABELS = ["positive", "negative"]

REVIEWS = [
    "Absolutely loved it. The food was delicious and the staff were wonderful.",
    "Terrible service, cold food, and we waited an hour. Never again.",
    "A fantastic film with great acting. I would happily watch it again.",
    "The product broke after one day and support never answered. Awful.",
]


@rl.function
def classify(s, review):
    s += "Decide whether each review is positive or negative.\n\n"
    s += "Review: The hotel was clean and the view was beautiful.\nSentiment: positive\n\n"
    s += "Review: The battery died within an hour and the screen cracked.\nSentiment: negative\n\n"
    s += "Review: " + review + "\nSentiment: "
    s += rl.select("label", choices=LABELS)


def main(backend=None) -> list[dict]:
    backend = backend or rl.Engine(model="smollm2-135m")
    states = classify.run_batch([{"review": r} for r in REVIEWS], backend=backend, temperature=0)
    results = []
    for review, state in zip(REVIEWS, states):
        scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
        results.append({"review": review, "label": state["label"], "scores": dict(zip(LABELS, scores))})
        shown = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
        print(f"{state['label']:9s} [{shown}]  {review}")
    return results


if __name__ == "__main__":
    main()
