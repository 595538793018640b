"""Retrieval-augmented generation over a small document shipped with the examples.

Run it:  python examples/rag.py

What it shows:
- Retrieval is ordinary Python: here a keyword retriever scores the paragraphs of
  examples/data/orchard_cooperative.txt by the question words they contain (a real application
  would use a search index or embeddings; the program around it stays the same).
- The retrieved paragraphs go into the prompt; the model answers from them. The document is
  fictional, so a correct answer can only come from the retrieved context.
- `run_batch` answers several questions concurrently; the shared system prompt is cached.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "40"))
DOCUMENT = Path(__file__).parent / "data" / "orchard_cooperative.txt"
STOPWORDS = frozenset(
    "a an and are as at be by can do does for from has have how in is it its of on or the their "
    "there to was what when where which who why with".split()
)


def load_passages(path: Path = DOCUMENT) -> list[str]:
    """The document's paragraphs (blank-line separated), skipping the title line."""
    paragraphs = [p.strip() for p in path.read_text().split("\n\n")]
    return [p for p in paragraphs if len(p.split()) > 8]


def keywords(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS}


def retrieve(question: str, passages: list[str], k: int = 2) -> list[str]:
    """The k passages sharing the most keywords with the question (ties: document order)."""
    wanted = keywords(question)
    ranked = sorted(range(len(passages)), key=lambda i: -len(wanted & keywords(passages[i])))
    return [passages[i] for i in sorted(ranked[:k])]


@rl.function
def answer(s, question, passages):
    s += rl.system("Answer the question using only the context. Reply with one short sentence.")
    s += rl.user("Context:\n" + "\n\n".join(passages) + "\n\nQuestion: " + question)
    s += rl.assistant(rl.gen("answer", max_tokens=MAX_TOKENS))


QUESTIONS = [
    "In what year was the cooperative founded?",
    "Who is the current chair of the board?",
    "In which village is the Lantern Harvest Festival held?",
]


def main(backend=None) -> list[dict]:
    backend = backend or rl.Engine(model="smollm2-135m")
    passages = load_passages()
    batch = [{"question": q, "passages": retrieve(q, passages)} for q in QUESTIONS]
    states = answer.run_batch(batch, backend=backend, temperature=0)
    results = []
    for item, state in zip(batch, states):
        results.append({"question": item["question"], "passages": item["passages"],
                        "answer": state["answer"].strip()})
        print(f"Q: {item['question']}\nA: {state['answer'].strip()}\n")
    return results


if __name__ == "__main__":
    main()
