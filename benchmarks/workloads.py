"""Deterministic benchmark workloads: few-shot, multi-turn chat, unique prompts and long-prompt prefill.

Every workload is generated from the word lists and templates in this file and a seed (no data
downloads), so the same ``(seed, size)`` always yields the same prompts, byte for byte. A workload
is a list of *rounds*: all requests of a round are submitted together (one batch), and a round
starts only when the previous one has finished (turns of a conversation are sequential, the
conversations of one turn run in parallel). Every request also names its *group* (the
conversation, or the request itself) so that a benchmark may sample whole groups.

``optimal_hit_rate`` gives the best prefix-cache hit rate any runtime could reach on a trace of
tokenized prompts, to compare the measured hit rate against.

The offline benchmark (``benchmarks/offline.py``) uses these; serving and program benchmarks
reuse them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Renderer = Callable[[list[dict]], str]
TokenCounter = Callable[[str], int]

# ------------------------------------------------------------------------------------------ word lists

NAMES = (
    "Alice", "Bruno", "Chen", "Dara", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
    "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yusuf",
    "Zoe", "Amir", "Bea", "Carlos", "Dmitri", "Emma", "Felix", "Gita",
)
ITEMS = (
    "apple", "book", "marble", "pencil", "stamp", "coin", "shell", "card", "ticket", "candle", "button",
    "cookie", "kite", "ribbon", "sticker", "lemon", "brick", "feather", "spoon", "leaf",
)
CAPITALS = (
    ("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Peru", "Lima"),
    ("Italy", "Rome"), ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Chile", "Santiago"), ("Spain", "Madrid"),
    ("Ghana", "Accra"), ("India", "New Delhi"), ("Cuba", "Havana"), ("Poland", "Warsaw"),
    ("Greece", "Athens"), ("Turkey", "Ankara"), ("Mexico", "Mexico City"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"), ("Vietnam", "Hanoi"),
    ("Morocco", "Rabat"), ("Argentina", "Buenos Aires"),
)
OPPOSITES = (
    ("hot", "cold"), ("tall", "short"), ("early", "late"), ("full", "empty"), ("light", "dark"),
    ("fast", "slow"), ("open", "closed"), ("rich", "poor"), ("happy", "sad"), ("strong", "weak"),
    ("wet", "dry"), ("loud", "quiet"), ("young", "old"), ("hard", "soft"), ("near", "far"),
    ("clean", "dirty"), ("thick", "thin"), ("sharp", "dull"), ("heavy", "light"), ("cheap", "expensive"),
)
WORDS = (
    "river", "mountain", "garden", "window", "engine", "signal", "harbor", "forest", "lantern", "bridge",
    "market", "library", "planet", "orchard", "circuit", "valley", "island", "village", "desert", "canyon",
    "meadow", "station", "theater", "museum", "kitchen", "factory", "compass", "journey",
    "winter", "summer", "morning", "evening", "thunder", "silver", "copper", "marble", "crystal", "shadow",
    "whisper", "melody", "rhythm", "pattern", "puzzle", "answer", "question", "reason", "memory", "story",
    "message", "letter", "number", "measure", "balance", "energy", "motion", "pressure", "surface",
    "current", "network", "process", "method", "result", "system", "detail", "moment", "season", "weather",
    "animal", "teacher", "student", "farmer", "sailor", "painter", "doctor", "builder", "pilot", "writer",
    "quickly", "slowly", "carefully", "quietly", "bright", "gentle", "ancient", "modern", "simple",
    "complex", "narrow", "broad", "distant", "hidden", "golden", "frozen", "curious", "patient", "steady",
    "careful", "builds", "carries", "follows", "gathers", "measures", "opens", "repairs", "studies",
    "watches", "writes", "crosses", "explores", "collects", "describes", "imagines", "remembers",
    "through", "beneath", "across", "between", "toward", "around", "beyond", "within", "under", "over",
)
OPENERS = (
    "Describe", "Explain", "Summarize", "Imagine", "Compare", "List", "Write", "Consider", "Suppose",
    "Outline", "Evaluate", "Discuss", "Analyze", "Picture", "Invent", "Draft", "Sketch", "Translate",
    "Critique", "Predict", "Recall", "Classify", "Rewrite", "Review", "Plan", "Design", "Tell", "Argue",
    "Estimate", "Contrast", "Narrate", "Propose", "Identify", "Justify", "Interpret", "Illustrate",
    "Defend", "Question", "Examine", "Reflect", "Explore", "Paraphrase", "Rank", "Invite", "Recommend",
    "Compose", "Formulate", "Derive",
)
TOPICS = (
    "volcanoes", "honeybees", "the history of paper", "solar energy", "coral reefs", "the printing press",
    "black holes", "bread baking", "chess openings", "the water cycle", "ancient Rome", "migratory birds",
    "electric cars", "the human heart", "glaciers", "jazz music", "origami", "lighthouses", "tea culture",
    "the moon landing", "rainforests", "clock making", "deep sea fish", "windmills", "the Silk Road",
    "bicycles", "vaccines", "earthquakes", "photosynthesis", "railways", "board games", "octopuses",
)
AUDIENCES = ("a ten-year-old", "a busy manager", "a first-year student", "my grandmother", "a new colleague")
ASPECTS = ("the main idea", "the most surprising fact", "the biggest open question", "the practical use",
           "the early history")

FEW_SHOT_HEADER = "Answer each question with a short, exact answer.\n\n"


# ------------------------------------------------------------------------------------------ data types


@dataclass(frozen=True, slots=True)
class Request:
    prompt: str
    max_new_tokens: int
    group: int  # conversation (multi-turn) or the request itself; sampling keeps whole groups
    round: int  # submission batch: rounds run one after another, a round's requests together


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    rounds: list[list[Request]]
    params: dict = field(default_factory=dict)  # the generator's arguments, for reports

    @property
    def requests(self) -> list[Request]:
        """All requests in submission order."""
        return [r for rnd in self.rounds for r in rnd]

    @property
    def num_groups(self) -> int:
        return len({r.group for r in self.requests})

    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def sample(self, max_requests: int | None, per_round: bool = False) -> Workload:
        """A part of the workload to run instead of all of it (``None``: everything).

        Default: the first groups (in order of first submission) holding at most ``max_requests``
        requests, always at least one, each with all its rounds (whole conversations).
        ``per_round``: the first ``max_requests`` requests of every round (whole batches per turn;
        the rounds of multi-turn list conversations in the same order, so these are whole
        conversations too)."""
        if max_requests is None or max_requests >= len(self.requests):
            return self
        if per_round:
            rounds = [rnd[:max_requests] for rnd in self.rounds]
        else:
            sizes: dict[int, int] = {}
            for r in self.requests:
                sizes[r.group] = sizes.get(r.group, 0) + 1
            keep: set[int] = set()
            total = 0
            for g, n in sizes.items():  # dicts keep first-submission order
                if keep and total + n > max_requests:
                    break
                keep.add(g)
                total += n
            rounds = [[r for r in rnd if r.group in keep] for rnd in self.rounds]
        return Workload(self.name, self.description, [rnd for rnd in rounds if rnd], dict(self.params))


def sampling_params(req: Request) -> dict:
    """Greedy, exactly ``max_new_tokens`` tokens (EOS ignored), so every system generates the same count."""
    return {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True}


# ------------------------------------------------------------------------------------------ helpers


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate (about 4 characters per token for English BPE vocabularies)."""
    return max(1, len(text) // 4)


def chatml(messages: list[dict]) -> str:
    """A minimal ChatML renderer with a generation prompt (the default when no tokenizer is given)."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def scaled(count: int, scale: float, minimum: int = 2) -> int:
    return max(minimum, round(count * scale))


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", str(a + b)
    if kind == 1:
        country, capital = rng.choice(CAPITALS)
        return f"What is the capital of {country}?", capital
    if kind == 2:
        word, opposite = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            word, opposite = opposite, word
        return f'What is the opposite of "{word}"?', opposite
    if kind == 3:
        a, b = rng.sample(range(10, 1000), 2)
        return f"Which number is larger, {a} or {b}?", str(max(a, b))
    if kind == 4:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", str(a * b)
    word = rng.choice(WORDS)
    return f'How many letters are in the word "{word}"?', str(len(word))


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def _paragraph(rng: random.Random, n_words: int) -> str:
    out, left = [], n_words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        out.append(_sentence(rng, n))
        left -= n
    return " ".join(out)


# ------------------------------------------------------------------------------------------ workloads


def few_shot(
    num_questions: int = 64,
    prefix_tokens: int = 600,
    max_new_tokens: int = 16,
    seed: int = 0,
    count_tokens: TokenCounter = approx_tokens,
) -> Workload:
    """``num_questions`` prompts sharing one few-shot prefix of about ``prefix_tokens`` tokens
    (examples "Q: ... A: ..." added until ``count_tokens(prefix) >= prefix_tokens``), each followed by
    its own question; plain text, no chat template. One round."""
    rng = random.Random(f"few-shot/{seed}")
    prefix, seen = FEW_SHOT_HEADER, set()
    while count_tokens(prefix) < prefix_tokens:
        q, a = _qa(rng)
        if q in seen:
            continue
        seen.add(q)
        prefix += f"Q: {q}\nA: {a}\n\n"
    requests = []
    while len(requests) < num_questions:
        q, _ = _qa(rng)
        if q in seen:
            continue
        seen.add(q)
        i = len(requests)
        requests.append(Request(prefix + f"Q: {q}\nA:", max_new_tokens, group=i, round=0))
    return Workload(
        "few-shot", f"{num_questions} questions sharing a ~{prefix_tokens}-token few-shot prefix",
        [requests], dict(num_questions=num_questions, prefix_tokens=prefix_tokens,
                         max_new_tokens=max_new_tokens, seed=seed),
    )


def conversations(num_conversations: int = 16, turns: int = 4, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Scripted (user message, assistant reply) pairs per conversation; the reply is fixed text, so
    every system sees identical prompts whatever it generated."""
    rng = random.Random(f"multi-turn/{seed}")
    topics = rng.sample(TOPICS, min(num_conversations, len(TOPICS)))
    while len(topics) < num_conversations:
        topics.append(rng.choice(TOPICS))
    convs = []
    for topic in topics:
        pairs = []
        for t in range(turns):
            if t == 0:
                user = f"I would like to learn about {topic}. Can you give me a short overview?"
            elif t == turns - 1 and turns > 1:
                user = "Thanks! Can you summarize what we discussed in three short bullet points?"
            else:
                user = (f"How would you explain {rng.choice(ASPECTS)} of {topic} to {rng.choice(AUDIENCES)}? "
                        f"Please mention the {rng.choice(WORDS)} and the {rng.choice(WORDS)}.")
            reply = (f"Here is my answer about {topic}. " + _paragraph(rng, rng.randint(30, 45))
                     + f" I hope this helps you understand {topic} better.")
            pairs.append((user, reply))
        convs.append(pairs)
    return convs


def multi_turn(
    num_conversations: int = 16,
    turns: int = 4,
    max_new_tokens: int = 32,
    seed: int = 0,
    render: Renderer = chatml,
) -> Workload:
    """``num_conversations`` chats of ``turns`` turns; the prompt of turn t is the rendered history
    (scripted user and assistant messages of turns < t) plus the new user message, with the
    generation prompt. Round t holds turn t of every conversation."""
    rounds: list[list[Request]] = [[] for _ in range(turns)]
    for c, pairs in enumerate(conversations(num_conversations, turns, seed)):
        history: list[dict] = []
        for t, (user, reply) in enumerate(pairs):
            history.append({"role": "user", "content": user})
            rounds[t].append(Request(render(list(history)), max_new_tokens, group=c, round=t))
            history.append({"role": "assistant", "content": reply})
    return Workload(
        "multi-turn", f"{num_conversations} conversations x {turns} turns, history resent each turn",
        rounds, dict(num_conversations=num_conversations, turns=turns, max_new_tokens=max_new_tokens, seed=seed),
    )


def unique(
    num_prompts: int = 32,
    min_words: int = 75,
    max_words: int = 150,
    max_new_tokens: int = 128,
    seed: int = 0,
) -> Workload:
    """``num_prompts`` distinct prompts of ``min_words``..``max_words`` words (about 100-200 tokens);
    consecutive prompts open with different words, so they share no prefix beyond a few tokens."""
    rng = random.Random(f"unique/{seed}")
    openers: list[str] = []
    requests = []
    for i in range(num_prompts):
        if not openers:
            openers = list(OPENERS)
            rng.shuffle(openers)
        opener = openers.pop()
        body = _paragraph(rng, rng.randint(min_words, max_words))
        prompt = f"{opener} the following notes in your own words: {body}\n\nResponse:"
        requests.append(Request(prompt, max_new_tokens, group=i, round=0))
    return Workload(
        "unique", f"{num_prompts} distinct prompts of ~{min_words}-{max_words} words",
        [requests], dict(num_prompts=num_prompts, min_words=min_words, max_words=max_words,
                         max_new_tokens=max_new_tokens, seed=seed),
    )


def _policy_chat(company: str, policies: list[str], question: str) -> list[dict]:
    system = f"You are the support assistant of {company}. Follow these policies:\n" + "\n".join(policies)
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def prefill(
    num_prompts: int = 8,
    prompt_tokens: int = 1700,
    seed: int = 0,
    count_tokens: TokenCounter = approx_tokens,
    render: Renderer = chatml,
) -> Workload:
    """``num_prompts`` long chat prompts (a system prompt listing policies, then one user question),
    ``prompt_tokens`` tokens each (policies are added until the rendered prompt reaches it), one new
    token each: the time to first token of a long prompt. Each prompt names its own company and
    policies, so they share nothing beyond the chat template's first tokens."""
    rng = random.Random(f"prefill/{seed}")
    requests = []
    for i in range(num_prompts):
        company = f"{rng.choice(NAMES)} & {rng.choice(NAMES)} {rng.choice(TOPICS).title()} Ltd. (branch {i})"
        asks = random.Random(f"prefill/{seed}/{i}")
        question = f"{asks.choice(NAMES)} asks: which policy covers {asks.choice(ITEMS)}?"
        policies: list[str] = []
        while count_tokens(render(_policy_chat(company, policies, question))) < prompt_tokens:
            about = rng.choice(TOPICS)
            policies.append(f"{len(policies) + 1}. About {about}: {_sentence(rng, rng.randint(10, 18))}")
        requests.append(Request(render(_policy_chat(company, policies, question)), 1, group=i, round=0))
    return Workload(
        "prefill", f"{num_prompts} distinct chat prompts of ~{prompt_tokens} tokens, 1 new token each",
        [requests], dict(num_prompts=num_prompts, prompt_tokens=prompt_tokens, max_new_tokens=1, seed=seed),
    )


WORKLOADS = ("few-shot", "multi-turn", "unique", "prefill")


def build(
    name: str,
    scale: float = 1.0,
    seed: int = 0,
    count_tokens: TokenCounter = approx_tokens,
    render: Renderer = chatml,
) -> Workload:
    """A workload by name at the default size times ``scale`` (the number of requests or
    conversations scales; prompt shapes and output lengths do not)."""
    if name == "few-shot":
        return few_shot(scaled(64, scale), seed=seed, count_tokens=count_tokens)
    if name == "multi-turn":
        return multi_turn(scaled(16, scale), seed=seed, render=render)
    if name == "unique":
        return unique(scaled(32, scale), seed=seed)
    if name == "prefill":
        return prefill(scaled(8, scale), seed=seed, count_tokens=count_tokens, render=render)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# ------------------------------------------------------------------------------------------ analysis


def shared_prefix_lengths(token_lists: Sequence[Sequence[int]]) -> list[int]:
    """For each prompt in order: the longest token prefix it shares with any earlier prompt."""
    root: dict = {}
    out = []
    for ids in token_lists:
        node, n = root, 0
        for t in ids:  # walk the trie of earlier prompts as far as it goes
            nxt = node.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        out.append(n)
        for t in ids[n:]:  # then graft the rest of this prompt on
            node = node.setdefault(t, {})
    return out


def optimal_hit_rate(token_lists: Sequence[Sequence[int]], recompute_last: bool = True) -> float:
    """Shared tokens / total prompt tokens over a trace, with ``shared_prefix_lengths`` as the shared
    tokens. With ``recompute_last`` a prompt reuses at most ``len - 1`` tokens: its last token must
    run through the model to give the next-token logits (what a real cache can reach)."""
    total = sum(len(ids) for ids in token_lists)
    if total == 0:
        return 0.0
    shared = 0
    for ids, n in zip(token_lists, shared_prefix_lengths(token_lists)):
        shared += min(n, len(ids) - 1) if recompute_last else n
    return shared / total
