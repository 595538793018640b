"""Turns Engine.generate / /generate arguments into validated Reqs.

Shared by the Engine and the server's TokenizerManager, so both accept and reject exactly the
same inputs with the same typed errors (RequestError naming the field).
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, replace
from typing import Any

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.params import INT64_MAX, SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.runtime.request.token_cache import PrefixTokenizer

_ids = itertools.count()
MAX_TOP_LOGPROBS = 20
# token_ids_logprob: ids whose logprobs every output (and asked input) position reports; a request's
# report grows by this many entries a token
MAX_TOKEN_IDS_LOGPROB = 128
MAX_TOKEN_IDS_ENTRIES = 1 << 20  # and their logprobs over all the positions a request reports
MAX_RID_CHARS = 256
# stop conditions are checked against every request's tail on every step: bounded so one request
# cannot slow the batch (a list of many thousands would slow every request's steps)
STOP_LIMITS = {"stop": 64, "stop_token_ids": 1024}  # stop_regex: SamplingParams bounds it
MAX_STOP_CHARS = 256
# a constraint's spec (regex, JSON schema, EBNF, structural tag) is compiled per distinct spec:
# its size bounds the compile time and memory (a schema of megabytes compiles for most of a minute in GBs)
MAX_CONSTRAINT_CHARS = 100_000


def new_rid() -> str:
    return f"{uuid.uuid4().hex[:12]}{next(_ids)}"


@dataclass(slots=True)
class BuiltBatch:
    groups: list[list[Req]]  # one group per prompt; n samples in a group
    is_batch: bool

    @property
    def reqs(self) -> list[Req]:
        return [req for group in self.groups for req in group]


class RequestBuilder:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, pool_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.pool_size = pool_size
        self._max_token_chars: int | None = None
        self.token_cache = PrefixTokenizer(tokenizer)  # texts that extend one tokenized recently

    @classmethod
    def from_runner(cls, runner) -> RequestBuilder:
        return cls(runner.tokenizer, runner.vocab_size, runner.context_len, runner.allocator.num_slots)

    def build(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
              top_logprobs_num, stream, rid, max_generations: int | None = None,
              token_ids_logprob: list[int] | list[list[int]] | None = None) -> BuiltBatch:
        """Validated Reqs (n per prompt) with their accumulators; RequestError names the bad input.
        Every option, every text's size and the count of generations (against ``max_generations``) is
        checked before any text is tokenized, and everything before the first Req is built."""
        if (prompt is None) == (input_ids is None):
            raise RequestError(None, "give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("prompt", "must be a string or a non-empty list of strings")
            for text in texts:
                self.check_text(text)
            n = len(texts)
        else:
            is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
            token_lists = input_ids if is_batch else [input_ids]
            for ids in token_lists:
                self.check_ids(ids)
            n = len(token_lists)
        checked = self._check_options(n, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, rid)
        token_ids = self._check_token_ids_logprob(token_ids_logprob, n)
        total = sum(sp.n for sp, *_ in checked)
        if max_generations is not None and total > max_generations:
            raise RequestError("n" if n == 1 else "prompt", f"asks for {total} generations, more than this server "
                               f"ever holds at once ({max_generations}: max_running_requests + "
                               "max_queued_requests); split the request",
                               section="sampling_params" if n == 1 else None)
        token_lists = token_lists if prompt is None else self._tokenize_checked(texts)
        for ids, (sp, want_lp, start, *_), asked in zip(token_lists, checked, token_ids):
            self.check_length(ids, sp)
            if asked and want_lp:  # the report's size, before anything is allocated for it
                positions = (len(ids) - max(start, 0) if start >= 0 else 0) + max(sp.max_new_tokens, 1)
                if positions * len(asked) > MAX_TOKEN_IDS_ENTRIES:
                    raise RequestError("token_ids_logprob", f"asks for {len(asked)} ids at {positions} positions, "
                                       f"more than {MAX_TOKEN_IDS_ENTRIES} logprobs in all; ask fewer ids, fewer "
                                       "tokens or a later logprob_start_len")
        groups = [[Req(rid=base if sp.n == 1 else f"{base}-{k}", input_ids=list(ids),
                       params=sp if sp.n == 1 else _sample_k(sp, k), return_logprob=want_lp,
                       logprob_start_len=start, top_logprobs_num=top, stream=bool(stream), token_ids_logprob=asked)
                   for k in range(sp.n)]
                  for ids, (sp, want_lp, start, top, base), asked in zip(token_lists, checked, token_ids)]
        return BuiltBatch(groups, is_batch)

    def _check_options(self, n, sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
                       rid) -> list[tuple[SamplingParams, bool, int, int, str]]:
        params = _per_item("sampling_params", sampling_params, n)
        lp = _per_item("return_logprob", return_logprob, n)
        starts = _per_item("logprob_start_len", logprob_start_len, n)
        tops = _per_item("top_logprobs_num", top_logprobs_num, n)
        rids = _per_item("rid", rid, n)
        if len({r for r in rids if r is not None}) < sum(r is not None for r in rids):
            raise RequestError("rid", "has the same id twice")
        checked = []
        for i in range(n):
            check_stop_sizes(params[i])
            sp = SamplingParams.from_dict(params[i])
            self.check_vocab_ids(sp)
            check_constraint_size(sp)
            want_lp = _check_option("return_logprob", lp[i], bool, False)
            start = _check_option("logprob_start_len", starts[i], int, -1, low=-1)
            top = _check_option("top_logprobs_num", tops[i], int, 0, low=0, high=MAX_TOP_LOGPROBS)
            base = _check_option("rid", rids[i], str, None) or new_rid()
            if len(base) > MAX_RID_CHARS:
                raise RequestError("rid", f"is {len(base)} characters, the limit is {MAX_RID_CHARS}")
            checked.append((sp, want_lp, start, top, base))
        return checked

    def _check_token_ids_logprob(self, value: Any, n: int) -> list[list[int] | None]:
        """SGLang's token_ids_logprob per prompt: one list for every prompt, or a list per prompt."""
        if value is None:
            return [None] * n
        per_prompt = isinstance(value, list) and bool(value) and all(isinstance(v, list) for v in value)
        lists = _per_item("token_ids_logprob", value, n) if per_prompt else [value] * n
        for ids in lists:
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
                raise RequestError("token_ids_logprob", "must be a non-empty list of token ids in "
                                   f"[0, {self.vocab_size}) (or one such list per prompt)")
            if len(ids) > MAX_TOKEN_IDS_LOGPROB:
                raise RequestError("token_ids_logprob", f"lists {len(ids)} ids, the limit is {MAX_TOKEN_IDS_LOGPROB}")
        return [list(ids) for ids in lists]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_many([text])[0]

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, every text checked first; those no cached text serves are tokenized in one
        batch call (the tokenizer's threads, where TOKENIZERS_PARALLELISM allows)."""
        for text in texts:
            self.check_text(text)
        return self._tokenize_checked(texts)

    def _tokenize_checked(self, texts: list[str]) -> list[list[int]]:
        ids = self.token_cache.encode_batch(texts) if len(texts) > 1 else [self.token_cache.encode(texts[0])]
        return [undouble_bos(self.tokenizer, text, i) for text, i in zip(texts, ids)]

    def check_text(self, text: str) -> None:
        if not text:
            raise RequestError("prompt", "is empty")
        self.check_chars(text)

    def check_chars(self, text: str, field: str = "prompt") -> None:
        """Refuses, before tokenizing, a text too long to fit the context whatever its tokens: no
        token covers more characters than the longest vocabulary entry (a 3.9 MB prompt would
        otherwise take seconds of tokenizer time just to be refused)."""
        most = self.max_token_chars
        if most and len(text) > most * self.context_len:
            raise RequestError(field, f"is {len(text)} characters, at least {len(text) // most} tokens; the context "
                                      f"length is {self.context_len} tokens")

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters (0: unknown, no pre-check)."""
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=0)
            except Exception:  # a tokenizer without a vocabulary listing
                self._max_token_chars = 0
        return self._max_token_chars

    def default_max_new_tokens(self, prompt_len: int, cap: int | None = None) -> int:
        """max_new_tokens when a client gives none (chat): the room left in the context and the KV
        pool, at most `cap`."""
        room = min(self.context_len, self.pool_size) - prompt_len
        return max(min(room, cap or room), 1)

    def check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids", "must be a non-empty list of token ids")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestError("input_ids", f"contains {t!r}, not a token id in [0, {self.vocab_size})")

    def check_length(self, ids: list[int], sp: SamplingParams) -> None:
        """The prompt plus max_new_tokens must fit the context (as SGLang checks), the prompt the pool."""
        if len(ids) >= self.context_len:
            raise RequestError("prompt", f"is {len(ids)} tokens, the context length is {self.context_len} "
                                         "(prompt must leave room for at least one new token)")
        if len(ids) + 1 > self.pool_size:
            raise RequestError("prompt", f"is {len(ids)} tokens, larger than the KV pool ({self.pool_size} tokens)")
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise RequestError("max_new_tokens", f"= {sp.max_new_tokens} plus the prompt's {len(ids)} tokens "
                                                 f"exceeds the context length ({self.context_len} tokens)",
                               section="sampling_params")
        if len(ids) + sp.max_new_tokens > self.pool_size:  # alone in the pool it still could not finish
            raise RequestError("max_new_tokens", f"= {sp.max_new_tokens} plus the prompt's {len(ids)} tokens "
                                                 f"exceeds the KV pool ({self.pool_size} tokens, max_total_tokens); "
                                                 "it could never finish", section="sampling_params")

    def check_vocab_ids(self, sp: SamplingParams) -> None:
        """The token ids logit_bias and allowed_token_ids name are the vocabulary's."""
        for field, tokens in (("logit_bias", sp.logit_bias or ()), ("allowed_token_ids", sp.allowed_token_ids or ())):
            for token in tokens:
                if token >= self.vocab_size:
                    raise RequestError(field, f"names token {token}, not a token id in [0, {self.vocab_size})",
                                       section="sampling_params")


def _sample_k(sp: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n samples: one generation, its own seed when the request gives one."""
    return replace(sp, n=1, sampling_seed=None if sp.sampling_seed is None else (sp.sampling_seed + k) % 2**64)


def check_constraint_size(sp: SamplingParams) -> None:
    if sp.constraint is not None and len(sp.constraint[1]) > MAX_CONSTRAINT_CHARS:
        kind, spec = sp.constraint
        raise RequestError(kind, f"is {len(spec)} characters, the limit is {MAX_CONSTRAINT_CHARS}",
                           section="sampling_params")


def check_stop_sizes(params: Any) -> None:
    """Bounds the stop lists of a raw sampling_params dict, before anything is built from them."""
    if not isinstance(params, dict):
        return
    for name, limit in STOP_LIMITS.items():
        value = params.get(name)
        if not isinstance(value, list):
            continue
        if len(value) > limit:
            raise RequestError(name, f"has {len(value)} entries, the limit is {limit}", section="sampling_params")
        longest = max((len(v) for v in value if isinstance(v, str)), default=0)
        if longest > MAX_STOP_CHARS:
            raise RequestError(name, f"has an entry of {longest} characters, the limit is {MAX_STOP_CHARS}",
                               section="sampling_params")
    stop = params.get("stop")
    if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
        raise RequestError("stop", f"is {len(stop)} characters, the limit is {MAX_STOP_CHARS}",
                           section="sampling_params")


def _check_option(name: str, value: Any, kind: type, default: Any, low: int | None = None,
                  high: int | None = None) -> Any:
    """A per-prompt option: null means the default; ints are bounded (they cross processes)."""
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(name, f"must be {'an integer' if kind is int else 'a ' + kind.__name__}, got {value!r}")
    if kind is int:
        high = INT64_MAX if high is None else high
        if (low is not None and value < low) or value > high:
            raise RequestError(name, f"must be between {low} and {high}, got {value}")
    return value


def _per_item(name: str, value: Any, n: int) -> list:
    """One value per prompt: a list gives each its own (its length must match), anything else is shared."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(name, f"has {len(value)} items for {n} prompts")
        return value
    return [value] * n


def undouble_bos(tokenizer, text: str, ids: list[int]) -> list[int]:
    """`ids` of `text` without the tokenizer's added BOS when the text starts with its own (chat
    templates often write the BOS text themselves)."""
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and len(ids) > 1 and ids[0] == ids[1] == tokenizer.bos_token_id:
        return ids[1:]
    return ids
