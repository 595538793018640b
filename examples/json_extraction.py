"""Extract structured data as JSON that is guaranteed to match a schema.

Run it:  python examples/json_extraction.py

What it shows:
- `rl.gen("x", json_schema=...)` takes a JSON schema as a dict, a string, or a pydantic model
  class. The runtime masks every token that would break the schema, so the output always parses
  (no retries, no "please answer in JSON" prompting tricks).
- The schema also bounds the output (short strings, no extra keys), so generation ends as soon
  as the object is complete.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field

import radixlm.lang as rl


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=24)


TEXTS = [
    "Maria Lopez is a 34 year old architect who lives in Madrid.",
    "At 71, retired teacher John Smith still runs every morning in Boston.",
]


@rl.function
def extract(s, text):
    s += "Extract the person described in the text as JSON.\n\n"
    # one worked example shows the model what goes where
    s += "Text: Ken Ito, 52, repairs bicycles in a small shop in Osaka.\n"
    s += 'JSON: {"name": "Ken Ito", "age": 52, "city": "Osaka"}\n\n'
    s += "Text: " + text + "\nJSON:"
    # A complete object of this schema is about 25 tokens; 64 is a safe upper bound.
    s += rl.gen("person", json_schema=Person, max_tokens=64)


def main(backend=None) -> list[dict]:
    backend = backend or rl.Engine(model="smollm2-135m")
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
    people = []
    for text, state in zip(TEXTS, states):
        person = Person.model_validate(json.loads(state["person"]))  # always valid
        people.append(person.model_dump())
        print(f"{text}\n  -> {person!r}")
    return people


if __name__ == "__main__":
    main()
