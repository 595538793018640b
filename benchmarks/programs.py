"""SGLang-paper-shaped programs on the built-in model, run by three executors.

    python benchmarks/programs.py                 # default sizes: a few minutes on 2 CPU cores
    python benchmarks/programs.py --scale 4       # 4x more programs per workload
    python benchmarks/programs.py --programs few_shot_select fork_skeleton --executors engine naive

Programs (temperature 0, short outputs, deterministic inputs from the lists below):
  few_shot_select   8 shared worked examples (multiple-choice capitals), then a question; select A-D
  multi_choice      a unique short story opening, select the best of 4 full-sentence endings
  react_agent       shared ReAct instructions, 2 steps of thought gen + action select + argument
                    gen, each followed by a Python tool's observation
  fork_skeleton     skeleton-of-thought: 3 outline points, then fork(3) to expand them, join
  multi_turn_chat   system prompt + 3 user turns, each answered by a gen
  json_decoding     extract a person as JSON constrained by a schema (shared instruction + example)

Executors:
  engine    radixlm.lang on the in-process Engine: programs run concurrently (run_batch), their
            calls batch in the scheduler and reuse prefixes through the radix cache
  no-cache  the same, Engine(disable_radix_cache=True)
  naive     radixlm.lang on transformers (naive_hf.py): one call at a time, generate() per gen,
            a full forward pass per select choice, no reuse

Reported: programs/s (programs / wall time of the batch) and the prefix-cache hit rate (prompt
tokens served from the cache / prompt tokens, over the batch; the cache is flushed before each).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import radixlm.lang as rl  # noqa: E402

# --- inputs -----------------------------------------------------------------------------------

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"),
            ("Peru", "Lima"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Spain", "Madrid"),
            ("Chile", "Santiago"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Cuba", "Havana"),
            ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"),
            ("Vietnam", "Hanoi"), ("Turkey", "Ankara"), ("Ghana", "Accra")]
STORIES = [("put the kettle on the stove.", "When it whistled, {n} poured the water into a cup."),
           ("planted tomato seeds in the garden.", "A few weeks later, {n} saw the first green shoots."),
           ("found a stray cat outside the door.", "{n} gave it a bowl of milk and a warm blanket."),
           ("missed the last bus home.", "{n} called a taxi and waited under the shelter."),
           ("spilled coffee on the laptop keyboard.", "{n} quickly turned it off and dried the keys."),
           ("was invited to a birthday party.", "{n} wrapped a present and wrote a card."),
           ("heard thunder in the distance.", "{n} closed the windows and brought the chairs inside."),
           ("forgot the umbrella at the office.", "{n} got soaked walking home in the rain.")]
NAMES = ["Mia", "Leo", "Ana", "Sam", "Ivy", "Omar", "Zoe", "Raj", "Eva", "Tom", "Noa", "Kai"]
TOPICS = ["sleep better", "learn a new language", "save money", "start running", "cook healthy meals",
          "keep a garden", "study for exams", "reduce stress"]
CHAT_TURNS = [["Hi! Can you suggest a name for a cat?", "Why that name?", "Give one more idea."],
              ["What is a good breakfast?", "Is it healthy?", "How long does it take to make?"],
              ["Recommend a hobby for winter.", "What do I need to start?", "Is it expensive?"],
              ["What should I pack for a beach trip?", "And for a rainy day?", "Anything else?"]]
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
                 "properties": {"name": {"type": "string", "maxLength": 20},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                "city": {"type": "string", "maxLength": 20}}}
CITIES = ["Lyon", "Osaka", "Denver", "Porto", "Krakow", "Nairobi", "Quito", "Perth"]


def _mc_block(i: int, rng: random.Random) -> tuple[str, str]:
    country, capital = CAPITALS[i % len(CAPITALS)]
    options = [capital] + rng.sample([c for _, c in CAPITALS if c != capital], 3)
    rng.shuffle(options)
    lines = "".join(f"{letter}. {opt}\n" for letter, opt in zip("ABCD", options, strict=True))
    answer = "ABCD"[options.index(capital)]
    return f"Question: What is the capital of {country}?\n{lines}Answer:", answer


def few_shot_prefix() -> str:
    rng = random.Random(0)
    shots = [_mc_block(i, rng) for i in range(8)]
    return "Choose the correct answer.\n\n" + "".join(f"{q} {a}\n\n" for q, a in shots)


def make_inputs(name: str, n: int) -> list[dict]:
    rng = random.Random(1)
    if name == "few_shot_select":
        return [{"question": _mc_block(8 + i % 12, rng)[0]} for i in range(n)]
    if name == "multi_choice":
        items = []
        for i in range(n):
            k, who = i % len(STORIES), NAMES[i % len(NAMES)]
            wrong = [e.format(n=who) for j, (_, e) in enumerate(STORIES) if j != k]
            endings = [STORIES[k][1].format(n=who)] + rng.sample(wrong, 3)
            rng.shuffle(endings)
            items.append({"context": f"{who} {STORIES[k][0]}", "endings": [" " + e for e in endings]})
        return items
    if name == "react_agent":
        return [{"question": f"A shop sold {rng.randint(10, 99)} apples in the morning and "
                             f"{rng.randint(10, 99)} in the afternoon. How many apples did it sell?"}
                for _ in range(n)]
    if name == "fork_skeleton":
        return [{"topic": TOPICS[i % len(TOPICS)]} for i in range(n)]
    if name == "multi_turn_chat":
        return [{"turns": CHAT_TURNS[i % len(CHAT_TURNS)], "tag": i} for i in range(n)]
    if name == "json_decoding":
        return [{"text": f"{NAMES[i % len(NAMES)]} is {20 + (7 * i) % 60} years old and lives in "
                         f"{CITIES[i % len(CITIES)]}."} for i in range(n)]
    raise ValueError(name)


# --- programs ---------------------------------------------------------------------------------

FEW_SHOT = few_shot_prefix()
REACT = ("Answer the question. Use the calculator for arithmetic.\n"
         "Each step is a Thought, then an Action: calculator[expression] or finish[answer].\n\n"
         "Question: A box holds 12 pencils. How many pencils are in 7 boxes?\n"
         "Thought: I should use the calculator to multiply 12 by 7.\nAction: calculator[12 * 7]\n"
         "Observation: 84\nThought: The calculator says 84, so I can finish.\nAction: finish[84]\n")


def calculator(expression: str) -> str:
    """The agent's tool: `a op b` for integers a, b and op in + - * /."""
    match = re.fullmatch(r"\s*(\d+)\s*([-+*/])\s*(\d+)\s*", expression)
    if match is None:
        return "error: expected a op b"
    a, op, b = int(match[1]), match[2], int(match[3])
    if op == "/" and b == 0:
        return "error: division by zero"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


@rl.function
def few_shot_select(s, question):
    s += FEW_SHOT + question + rl.select("answer", [" A", " B", " C", " D"])


@rl.function
def multi_choice(s, context, endings):
    s += "Pick the most sensible continuation of the story.\n\n" + context
    s += rl.select("ending", endings)


@rl.function
def react_agent(s, question):
    s += REACT + "\nQuestion: " + question + "\n"
    for step in range(2):
        s += "Thought:" + rl.gen(f"thought_{step}", max_tokens=16, stop="\n") + "\n"
        s += "Action: " + rl.select(f"action_{step}", ["calculator", "finish"]) + "["
        s += rl.gen(f"arg_{step}", max_tokens=8, stop=["]", "\n"]) + "]\n"
        s += "Observation: " + calculator(s[f"arg_{step}"]) + "\n"


SOT_SYSTEM = ("You answer in two stages. First you write only the skeleton of the answer: exactly three "
              "points, numbered 1 to 3, each a few words, no details. Then each point is expanded on its "
              "own, in one or two short sentences, without repeating the other points. Be concrete and "
              "practical, prefer everyday advice, and never add an introduction or a conclusion.\n\n"
              "Example question: How can I drink more water?\nSkeleton:\n1. Carry a bottle\n"
              "2. Drink with every meal\n3. Set reminders\nExpansion of point 1: Keep a refillable bottle "
              "in your bag so water is always at hand.")


@rl.function
def fork_skeleton(s, topic):
    s += rl.system(SOT_SYSTEM)
    s += rl.user(f"How can I {topic}?")
    with s.assistant():
        s += "Skeleton:\n"
        for i in range(3):
            s += f"{i + 1}." + rl.gen(f"point_{i}", max_tokens=8, stop="\n") + "\n"
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += rl.user(f"Expand point {i + 1}.")
        branch += rl.assistant(rl.gen("expansion", max_tokens=12))
    forks.join()


@rl.function
def multi_turn_chat(s, turns, tag):
    s += rl.system("You are a friendly assistant. Answer briefly.")
    for i, turn in enumerate(turns):
        s += rl.user(f"{turn}" if i else f"(conversation {tag}) {turn}")
        s += rl.assistant(rl.gen(f"answer_{i}", max_tokens=16))


@rl.function
def json_decoding(s, text):
    s += ("Extract the person as JSON.\n\nText: Ken Ito is 52 years old and lives in Osaka.\n"
          'JSON: {"name": "Ken Ito", "age": 52, "city": "Osaka"}\n\n')
    s += "Text: " + text + "\nJSON:" + rl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=40)


# name -> (program, number of programs at --scale 1); sized so that the default run (all three
# executors) takes a few minutes on 2 CPU cores
PROGRAMS = {"few_shot_select": (few_shot_select, 6), "multi_choice": (multi_choice, 6),
            "react_agent": (react_agent, 3), "fork_skeleton": (fork_skeleton, 4),
            "multi_turn_chat": (multi_turn_chat, 3), "json_decoding": (json_decoding, 4)}


# --- harness ----------------------------------------------------------------------------------

def _cache_stats(backend) -> tuple[int, int]:
    info = backend.get_server_info().get("cache", {})
    return info.get("hit_tokens", 0), info.get("query_tokens", 0)


@rl.function
def warm_up(s):
    """Lazy one-time work out of the timings: chat-template measurement, grammar compilation."""
    s += rl.system("Hi") + rl.user("Hi") + rl.assistant(rl.gen("a", max_tokens=1))
    s += rl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=2) + rl.select("c", [" A", " B"])


def run_one(backend, name: str, n: int, concurrent: bool) -> dict:
    program, _ = PROGRAMS[name]
    items = make_inputs(name, n)
    backend.flush_cache()
    hits0, queries0 = _cache_stats(backend)
    start = time.perf_counter()
    states = program.run_batch(items, backend=backend, temperature=0, num_threads=n if concurrent else 1)
    wall = time.perf_counter() - start
    hits, queries = _cache_stats(backend)
    errors = [repr(st.error) for st in states if st.error is not None]
    if errors:
        print(f"  {name}: {len(errors)} program(s) failed, e.g. {errors[0]}", file=sys.stderr)
    rate = (hits - hits0) / (queries - queries0) if queries > queries0 else None
    return {"programs": n, "seconds": wall, "programs_per_s": n / wall, "hit_rate": rate,
            "errors": len(errors)}


def make_backend(executor: str, args) -> rl.Backend:
    if executor == "naive":
        from naive_hf import NaiveHFBackend

        from radixlm.runtime.executor.loader import resolve_model

        return NaiveHFBackend(str(resolve_model(args.model).folder), device=args.device)
    engine = rl.Engine(model=args.model, device=args.device, log_level="warning",
                       disable_radix_cache=executor == "no-cache")
    return rl.as_backend(engine)


def format_table(results: dict, names: list[str], executors: list[str]) -> str:
    head = ["program", "programs"]
    for ex in executors:
        head += [f"{ex} prog/s", f"{ex} hit"]
    if "engine" in executors:
        head += [f"engine / {ex}" for ex in executors if ex != "engine"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [name, str(next(iter(results[name].values()))["programs"])]
        for ex in executors:
            r = results[name][ex]
            cells += [f"{r['programs_per_s']:.2f}", "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"]
        if "engine" in executors:
            base = results[name]["engine"]["programs_per_s"]
            cells += [f"{base / results[name][ex]['programs_per_s']:.1f}x" for ex in executors if ex != "engine"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every program count")
    parser.add_argument("--programs", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--executors", nargs="+", choices=["engine", "no-cache", "naive"],
                        default=["engine", "no-cache", "naive"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    results: dict = {name: {} for name in args.programs}
    for executor in args.executors:
        backend = make_backend(executor, args)
        warm_up.run(backend=backend, temperature=0)
        for name in args.programs:
            n = max(1, round(PROGRAMS[name][1] * args.scale))
            r = results[name][executor] = run_one(backend, name, n, concurrent=executor != "naive")
            hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
            print(f"{executor:9s} {name:16s} {n:3d} programs {r['seconds']:7.2f}s "
                  f"{r['programs_per_s']:6.2f} prog/s  hit {hit}", flush=True)
        backend.shutdown()
    print()
    print(format_table(results, args.programs, args.executors))
    print("\ncommand:", shlex.join(["python", "benchmarks/programs.py", *(sys.argv[1:] if argv is None else argv)]))
    return results


if __name__ == "__main__":
    main()
