"""What the JSON end check costs per accepted token as an output grows (constrained/end_check.py).

    python benchmarks/end_check_cost.py [--items 10,50,200,800] [--token-bytes 4] [--json PATH]

A document of N objects in an array, accepted token by token (fixed-width byte tokens) by an
EndCheckedGrammar over a backend grammar that takes everything, so the end check alone is timed.
The baseline, in the same run, is the rule before the lexer: the document parsed and validated again
at every token that ends on a value's last byte (a closing quote, a digit, a bracket), which made the
check quadratic in the document's length. Both count how often the document was judged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from radixlm.constrained.base import Grammar  # noqa: E402
from radixlm.constrained.end_check import _VALUE_ENDS, EndCheckedGrammar, SchemaCheck  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}}


class AnyBytes(Grammar):
    def fill_mask(self, bitmask, row) -> None:
        pass

    def accept(self, token_id: int) -> bool:
        return True

    def accept_string(self, text: str) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def jump_forward(self) -> str | None:
        return None

    def rollback(self, k: int) -> None:
        pass

    def copy(self) -> AnyBytes:
        return AnyBytes()


def document(items: int) -> bytes:
    return json.dumps([{"name": f"person {i}", "age": 20 + i, "tags": ["a", "bb", f"t{i}"]}
                       for i in range(items)]).encode()


def measure(items: int, width: int) -> dict:
    doc = document(items)
    tokens = [doc[i:i + width] for i in range(0, len(doc), width)]
    check = SchemaCheck(SCHEMA)
    judged = []
    violation = check.violation
    check.violation = lambda d: judged.append(len(d)) or violation(d)  # type: ignore[method-assign]
    g = EndCheckedGrammar(AnyBytes(), check, tokens, (len(tokens),))
    t0 = time.perf_counter()
    for t in range(len(tokens)):
        g.accept(t)
    now = time.perf_counter() - t0
    if g._violation() is not None:
        raise AssertionError("the document should validate")
    seen, old_judged = bytearray(), 0
    t0 = time.perf_counter()
    for piece in tokens:  # the old rule: judge at every token ending on a value's last byte
        seen += piece
        end = seen.rstrip()
        if end and end[-1] in _VALUE_ENDS:
            violation(bytes(seen))
            old_judged += 1
    old = time.perf_counter() - t0
    return {"items": items, "bytes": len(doc), "tokens": len(tokens), "ms": now * 1e3, "judged": len(judged),
            "old_ms": old * 1e3, "old_judged": old_judged, "us_per_token": now / len(tokens) * 1e6,
            "old_us_per_token": old / len(tokens) * 1e6}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", default="10,50,200,800")
    p.add_argument("--token-bytes", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [measure(int(n), args.token_bytes) for n in args.items.split(",")]
    print("| objects | bytes | tokens | end check (ms) | judged | old rule (ms) | judged | us/token | old us/token |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['items']} | {r['bytes']} | {r['tokens']} | {r['ms']:.1f} | {r['judged']} | {r['old_ms']:.1f} | "
              f"{r['old_judged']} | {r['us_per_token']:.1f} | {r['old_us_per_token']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
