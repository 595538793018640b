"""Tests of radixlm.lang against a small deterministic fake of the Engine interface.

FakeEngine implements `Engine.generate` (single / list prompts, input_ids, stop strings, stop
token ids, max_new_tokens, input logprobs from logprob_start_len, streaming), a ChatML chat
template rendered by jinja2 (SmolLM2's, with its default system prompt) and records every call,
so the tests can check what the language sends, not only what it returns. select's tests are in
test_lang_select.py, roles' and the other backends' in test_lang_roles_backends.py (both use this fake).
"""

from __future__ import annotations

import re
import threading
import time

import jinja2
import pytest

import radixlm.lang as rl

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "n", "sampling_seed", "regex",
    "json_schema", "ebnf", "no_stop_trim",
}
TOKEN_RE = re.compile(r"<s>|<\|\w+\|>|\s*[^\s<]+|\s+|<")


class FakeTokenizer:
    """Word-level: a word carries its leading whitespace, so "is " + "Paris" re-tokenizes as
    "is", " Paris" (the prefix's last token merges with the choice, like BPE)."""

    def __init__(self, bos: bool = False) -> None:
        self._ids: dict[str, int] = {}
        self._tokens: list[str] = []
        self._lock = threading.Lock()
        self.eos_token_id = self._id("<|im_end|>")
        self.bos_token_id = self._id("<s>") if bos else None

    def _id(self, token: str) -> int:
        with self._lock:
            if token not in self._ids:
                self._ids[token] = len(self._tokens)
                self._tokens.append(token)
            return self._ids[token]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        lead = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return lead + [self._id(t) for t in TOKEN_RE.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._tokens[i] for i in ids)


def default_reply(prompt: str, sampling_params: dict) -> str:
    return f" answer{len(prompt)} is here<|im_end|> junk"


class FakeEngine:
    def __init__(self, template: str = SMOL_TEMPLATE, bos: bool = False) -> None:
        self.tokenizer = FakeTokenizer(bos)
        self.template = jinja2.Environment().from_string(template)
        self.reply = default_reply
        self.score = lambda context, token: -0.5 if token.strip() in self.liked else -2.0
        self.liked: set[str] = set()
        self.calls: list[dict] = []
        self.finished = 0
        self.barrier: threading.Barrier | None = None  # generating calls wait here (overlap proof)
        self.gate: threading.Event | None = None  # generating calls wait for it
        self.stream_step: threading.Semaphore | None = None  # each streamed chunk after the first waits
        self._lock = threading.Lock()

    # --- Engine interface ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=-1, top_logprobs_num=0, stream=False):
        call = dict(prompt=prompt, input_ids=input_ids, sampling_params=sampling_params,
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len, stream=stream,
                    start=time.monotonic())
        with self._lock:
            self.calls.append(call)
        batch = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        if input_ids is not None:
            ids_list = input_ids if batch else [input_ids]
        else:
            ids_list = [self.tokenizer.encode(p) for p in (prompt if batch else [prompt])]
        n = len(ids_list)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * n
        per = lambda v: v if isinstance(v, list) else [v] * n  # noqa: E731
        if any(p.get("max_new_tokens", 128) > 0 for p in params):
            if self.barrier is not None:
                self.barrier.wait(timeout=5)
            if self.gate is not None and not self.gate.wait(timeout=5):
                raise TimeoutError("gate never opened")
        rows = zip(ids_list, params, per(return_logprob), per(logprob_start_len), strict=True)
        results = [self._one(*row) for row in rows]
        call["end"] = time.monotonic()
        with self._lock:
            self.finished += 1
        if stream:
            return self._stream(results[0])
        return results if batch else results[0]

    def flush_cache(self) -> bool:
        return True

    def get_server_info(self) -> dict:
        return {"model": "fake"}

    def shutdown(self) -> None:
        pass

    # --- behaviour ----------------------------------------------------------------------------
    def _one(self, ids: list[int], sp: dict, return_logprob: bool, start: int) -> dict:
        for key in sp:
            if key not in SAMPLING_KEYS:
                raise ValueError(f"unknown sampling parameter {key}")
        if sp.get("temperature", 1.0) < 0:
            raise ValueError("temperature must be >= 0")
        text = self.tokenizer.decode(ids)
        limit = sp.get("max_new_tokens", 128)
        out = "" if limit == 0 else self.reply(text, sp)
        finish: dict = {"type": "length"}
        hits = [(out.find(s), s) for s in sp.get("stop", []) if s in out]
        if hits:
            at, matched = min(hits)
            out, finish = out[:at], {"type": "stop", "matched": matched}
        out_ids = self.tokenizer.encode(out, add_special_tokens=False)
        stop_ids = set(sp.get("stop_token_ids", [])) | {self.tokenizer.eos_token_id}
        for i, t in enumerate(out_ids):
            if t in stop_ids:
                out_ids, finish = out_ids[:i], {"type": "stop", "matched": t}
                break
        if len(out_ids) > limit:
            out_ids, finish = out_ids[:limit], {"type": "length"}
        meta = {"id": "fake", "prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                "cached_tokens": 0, "finish_reason": finish}
        if return_logprob:
            decode = self.tokenizer.decode
            meta["input_token_logprobs"] = [
                (None if p == 0 else self.score(decode(ids[:p]), decode([ids[p]])), ids[p], None)
                for p in range(start if start >= 0 else len(ids), len(ids))
            ]
        return {"text": self.tokenizer.decode(out_ids), "output_ids": out_ids, "meta_info": meta}

    def _stream(self, result: dict):
        """A token a chunk, each chunk's text and ids those so far (the Engine's default)."""
        ids = result["output_ids"]
        for i in range(len(ids)):
            if i and self.stream_step is not None and not self.stream_step.acquire(timeout=5):
                raise TimeoutError("the stream reader never asked for the next chunk")
            meta = {"finish_reason": result["meta_info"]["finish_reason"]} if i == len(ids) - 1 else {}
            yield {"text": self.tokenizer.decode(ids[:i + 1]), "output_ids": ids[:i + 1], "meta_info": meta}
        if not ids:
            yield {"text": "", "output_ids": [], "meta_info": dict(result["meta_info"])}

    def generating_calls(self) -> list[dict]:
        def generating(call):
            sps = call["sampling_params"]
            sps = sps if isinstance(sps, list) else [sps or {}]
            return any(sp.get("max_new_tokens", 128) > 0 for sp in sps)

        return [c for c in self.calls if generating(c)]


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


def expected_reply(prompt: str) -> str:
    return f" answer{len(prompt)} is here"


# --- gen ------------------------------------------------------------------------------------------

def test_gen_appends_text_and_sets_variable(fake):
    @rl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:"
        s += rl.gen("answer", max_tokens=16, stop="\n")

    state = qa.run(question="2+2?", backend=fake, temperature=0)
    prompt = "Q: 2+2?\nA:"
    assert state["answer"] == expected_reply(prompt)
    assert state.text() == prompt + state["answer"]
    (call,) = fake.calls
    assert call["prompt"] == prompt
    sp = call["sampling_params"]
    assert sp["max_new_tokens"] == 16 and sp["stop"] == ["\n"] and sp["temperature"] == 0
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"
    assert "answer" in state and "other" not in state


def test_append_returns_at_once_and_reading_waits(fake):
    fake.gate = threading.Event()

    @rl.function
    def prog(s):
        s += "Hi" + rl.gen("x", max_tokens=4)
        assert fake.finished == 0  # the gen is still waiting in the engine
        fake.gate.set()
        return s["x"]

    state = prog.run(backend=fake)
    assert state.ret_value == expected_reply("Hi")
    assert fake.finished == 1


def test_dtype_int_sets_a_regex_constraint(fake):
    fake.reply = lambda prompt, sp: "42" if sp.get("regex") else " words"

    @rl.function
    def prog(s):
        s += "n = " + rl.gen("n", dtype=int) + "; m = " + rl.gen_int("m")
        s += "; f = " + rl.gen("f", dtype="float")

    state = prog.run(backend=fake)
    regexes = [c["sampling_params"]["regex"] for c in fake.calls]
    assert regexes[0] == regexes[1] != regexes[2]
    assert re.fullmatch(regexes[0], "-42") and not re.fullmatch(regexes[0], "4.2")
    assert re.fullmatch(regexes[2], "4.25")
    assert state["n"] == state["m"] == "42"
    with pytest.raises(ValueError, match="dtype"):
        rl.gen("x", dtype=list)


def test_stream_pieces_concatenate_to_the_final_value(fake):
    @rl.function
    def prog(s):
        s += "Tell me:" + rl.gen("x", max_tokens=32)

    fake.stream_step = threading.Semaphore(0)  # the engine yields a chunk only after the last was read
    state = prog.run(backend=fake, stream=True)
    pieces = []
    for piece in state.text_iter("x"):
        pieces.append(piece)
        fake.stream_step.release()
    assert pieces == [" answer8", " is", " here"]
    assert "".join(pieces) == state["x"] == expected_reply("Tell me:")
    assert "".join(state.text_iter()) == state.text() == "Tell me:" + state["x"]
    assert fake.calls[0]["stream"] is True


def test_var_scope_captures_the_text_appended_inside(fake):
    @rl.function
    def prog(s):
        s += "Start. "
        with s.var_scope("para"):
            s += "Hello" + rl.gen("w", max_tokens=3)
        s += " End."

    state = prog.run(backend=fake)
    assert state["para"] == "Hello" + state["w"]
    assert state.text() == "Start. " + state["para"] + " End."


# --- errors and batches ---------------------------------------------------------------------------

def test_run_batch_keeps_order_and_isolates_errors(fake, capsys):
    @rl.function
    def prog(s, i):
        if i == 2:
            raise ValueError("bad item")
        s += f"Item {i}:" + rl.gen("x", max_tokens=8)

    states = prog.run_batch([{"i": i} for i in range(5)], backend=fake, num_threads=3, progress_bar=True)
    assert len(states) == 5
    for i, state in enumerate(states):
        if i == 2:
            assert isinstance(state.error(), ValueError)
            with pytest.raises(ValueError, match="bad item"):
                state["x"]
        else:
            assert state.error() is None
            assert state["x"] == expected_reply(f"Item {i}:")
    assert "5/5" in capsys.readouterr().err


def test_backend_error_surfaces_on_its_state_only(fake):
    @rl.function
    def prog(s, t):
        s += "x" + rl.gen("x", temperature=t, max_tokens=4)

    ok, bad = prog.run_batch([{"t": 0.5}, {"t": -1.0}], backend=fake)
    assert ok.error() is None and ok["x"] == expected_reply("x")
    assert isinstance(bad.error(), ValueError) and "temperature" in str(bad.error())
    with pytest.raises(ValueError, match="temperature"):
        bad["x"]
    single = prog.run(t=-1.0, backend=fake)  # a failing gen does not raise from run()
    with pytest.raises(ValueError, match="temperature"):
        single.get_meta_info("x")


def test_user_code_exception_propagates_from_run(fake):
    @rl.function
    def prog(s):
        s += "a"
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        prog.run(backend=fake)


def test_misuse_gives_clear_errors(fake):
    @rl.function
    def nested(s):
        with s.user():
            s += rl.assistant("x")

    assert "do not nest" in str(nested.run(backend=fake).error())
    with pytest.raises(ValueError, match="None"):
        rl.function(lambda s: s.__iadd__(None)).run(backend=fake)
    with pytest.raises(ValueError, match="choices"):
        rl.select("x", choices=[])
    with pytest.raises(TypeError, match="batch_kwargs"):
        rl.function(lambda s: None).run_batch([{}], backend=fake, question="q")


# --- fork / join ----------------------------------------------------------------------------------

def test_fork_branches_run_concurrently_and_gather(fake):
    fake.barrier = threading.Barrier(2)  # each branch's gen blocks until the other one arrives

    @rl.function
    def prog(s):
        s += "Ideas:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + rl.gen("idea", max_tokens=8, stop="\n")
        forks.join()
        fake.barrier = None
        s += "Summary:" + rl.gen("summary", max_tokens=8)

    state = prog.run(backend=fake)
    assert state.error() is None
    assert state["idea"] == [expected_reply("Ideas:\n1."), expected_reply("Ideas:\n2.")]
    head = fake.calls[0]  # fork caches the shared prefix first (prefill only)
    assert head["prompt"] == "Ideas:\n" and head["sampling_params"] == {"max_new_tokens": 0}
    first, second, summary = fake.generating_calls()
    assert max(first["start"], second["start"]) < min(first["end"], second["end"])
    assert summary["prompt"] == "Ideas:\nSummary:"


def test_join_concate_and_append(fake):
    @rl.function
    def prog(s):
        s += "Start:"
        forks = s.fork(3)
        assert len(forks) == 3 and list(forks) == [forks[0], forks[1], forks[2]]
        forks += lambda i: f" [{i}]" + rl.gen("g", max_tokens=2)
        forks.join("concate_and_append")
        return [f["g"] for f in forks]

    state = prog.run(backend=fake)
    assert state.text() == "Start:" + "".join(f" [{i}]" + g for i, g in enumerate(state.ret_value))
    with pytest.raises(ValueError, match="join mode"):
        rl.function(lambda s: s.fork(1).join("merge")).run(backend=fake)
