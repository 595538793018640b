"""One client's streamed decode speed on running servers, rounds interleaved across them.

    python benchmarks/one_client.py NAME=URL [NAME=URL ...] [--rounds 6] [--max-tokens 128] [--peer NAME]
        [--context-words N]

Each round sends every server the same greedy `/v1/completions` request (a new prompt each round, so
no server answers from its cache), streamed, `ignore_eos`, and times the tokens after the first over
the time after the first: decode speed without the prefill. Servers take turns within a round, so
load from elsewhere on the machine hits them alike. `--context-words N` puts N filler words in front
of each prompt, for decode over a long context (1,000 words are about 3,900 tokens on SmolLM2's
tokenizer). Prints the median per server and, with
`--peer`, each median over the peer's (llama-server speaks the same API).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from tqdm import tqdm


def decode_speed(url: str, prompt: str, max_tokens: int, timeout: float) -> float:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    first, count = None, 0
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if json.loads(line[5:])["choices"][0].get("text"):
                count += 1
                first = first or time.perf_counter()
    if first is None or count < 2:
        raise RuntimeError(f"{url} streamed {count} token(s)")
    return (count - 1) / (time.perf_counter() - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("servers", nargs="+", help="NAME=URL")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--peer", help="the NAME the others are compared with")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--context-words", type=int, default=0, help="filler words before each prompt")
    args = p.parse_args()
    servers = dict(s.split("=", 1) for s in args.servers)
    if args.peer is not None and args.peer not in servers:
        p.error(f"--peer {args.peer!r} is not one of {sorted(servers)}")
    speeds: dict[str, list[float]] = {name: [] for name in servers}
    filler = " ".join(f"word{j}" for j in range(args.context_words))
    with tqdm(total=args.rounds * len(servers), desc="requests") as bar:
        for i in range(args.rounds):
            # the round first: the filler must not make a prefix the next round finds cached
            prompt = (f"Round {i}. {filler} " if filler else "") + f"Write a long story about a dragon number {i}."
            for name, url in servers.items():
                speeds[name].append(decode_speed(url, prompt, args.max_tokens, args.timeout))
                bar.update()
    peer = statistics.median(speeds[args.peer]) if args.peer else None
    context = f", after {args.context_words} filler words" if args.context_words else ""
    print(f"\n{args.max_tokens} greedy tokens{context}, {args.rounds} interleaved rounds\n")
    print("| server | decode tok/s (median) | rounds |" + (f" / {args.peer} |" if peer else ""))
    print("|---|--:|---|" + ("--:|" if peer else ""))
    for name, values in speeds.items():
        median = statistics.median(values)
        row = f"| {name} | {median:.1f} | {', '.join(f'{v:.1f}' for v in values)} |"
        print(row + (f" {median / peer:.2f}x |" if peer else ""))


if __name__ == "__main__":
    main()
