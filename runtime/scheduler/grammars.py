"""Grammar-constrained decoding inside the scheduler: compile queue, masks, jump-forward.

Requests with a constraint wait here while their grammar compiles on the backend's thread pool,
so a slow spec never stalls the decode loop for everyone else. A spec that fails to compile, takes
longer than the compile timeout or admits no output finishes only its own request (a 400 with the
reason); a compile no request waits for any more is abandoned (cancelled, dropped from the cache).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable

import torch

from radixlm.constrained.base import Grammar, GrammarError
from radixlm.constrained.bitmask import ids_to_bitmask
from radixlm.runtime.request.healing import HealingGrammar
from radixlm.runtime.request.healing import wrap as wrap_healing
from radixlm.runtime.request.reasoning import AfterThinking
from radixlm.runtime.request.req import FinishReason, Req
from radixlm.runtime.request.token_rules import TokenRules, bad_word_ids

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0


class GrammarManager:
    def __init__(self, backend_name: str, tokenizer, vocab_size: int, stop_ids, jump_forward: bool,
                 compile_timeout: float = COMPILE_TIMEOUT_S):
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.jump_forward_enabled = jump_forward
        self.compile_timeout = compile_timeout
        self._backend = None
        self._token_bytes: list[bytes | None] | None = None
        self._codec: tuple[Callable[[str], list[int]], Callable[[list[int]], str]] | None = None
        self.pending: list[tuple[Req, cf.Future, float]] = []
        self._pinned: torch.Tensor | None = None  # CUDA: the host bitmask, page-locked once

    @property
    def backend(self):
        if self._backend is None:  # xgrammar import + tokenizer tables: only when first needed
            from radixlm.constrained import create_grammar_backend

            self._backend = create_grammar_backend(
                self.backend_name, self.tokenizer, self.vocab_size, stop_token_ids=self.stop_ids
            )
        return self._backend

    def submit(self, req: Req) -> None:
        kind, spec = req.params.constraint
        self.pending.append((req, self.backend.compile_async(kind, spec), time.monotonic() + self.compile_timeout))

    def poll(self) -> tuple[list[Req], list[Req]]:
        """Requests whose grammar is ready, and requests that failed (finish set)."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for req, fut, deadline in self.pending:
            if fut.done():
                try:
                    inner = fut.result()
                    if req.after_thinking is not None:
                        inner = AfterThinking(inner, *req.after_thinking, stop_ids=self.backend.stop_token_ids)
                    inner = self.with_rules(req, inner)
                    req.grammar = wrap_healing(req, inner, self.tokenizer, self.backend.stop_token_ids)
                except Exception as e:
                    req.finish = FinishReason("abort", message=str(e), code=400)
                    failed.append(req)
                    continue
                if self._allows_nothing(req.grammar):
                    req.grammar = None
                    req.finish = FinishReason("abort", message=f"the {_named(req)} admits no output at all "
                                              "(nothing can match it)", code=400)
                    failed.append(req)
                else:
                    ready.append(req)
            elif now > deadline:
                self.backend.abandon(*req.params.constraint)
                req.finish = FinishReason("abort", message=f"the {req.params.constraint[0]} took over "
                                          f"{self.compile_timeout:g}s to compile (grammar_compile_timeout); "
                                          "simplify it",
                                          code=400)
                failed.append(req)
            else:
                still.append((req, fut, deadline))
        self.pending = still
        return ready, failed

    def with_rules(self, req: Req, inner: Grammar | None) -> Grammar | None:
        """`inner` (the request's compiled grammar, or None) under the request's allowed_token_ids and
        bad_words, when it has either (request/token_rules.py)."""
        p = req.params
        if p.allowed_token_ids is None and not p.bad_words:
            return inner
        allowed = None if p.allowed_token_ids is None else ids_to_bitmask(p.allowed_token_ids,
                                                                          (self.vocab_size + 31) // 32)
        banned = bad_word_ids(p.bad_words or [], self.codec[0])
        return TokenRules(inner, allowed, banned, () if inner is None else self.backend.stop_token_ids)

    def remove(self, rid: str) -> Req | None:
        for i, (req, _, _) in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                self.backend.abandon(*req.params.constraint)
                return req
        return None

    def cache_info(self) -> dict:
        """The compile cache's figures ({} before the first constrained request)."""
        return {} if self._backend is None else self._backend.cache_info()._asdict()

    def _allows_nothing(self, grammar) -> bool:
        """True for a fresh grammar whose first step allows no token at all."""
        from radixlm.constrained import allocate_bitmask

        bitmask = allocate_bitmask(1, self.vocab_size)
        try:
            grammar.fill_mask(bitmask, 0)
        except Exception:  # reported when the request is masked
            return False
        return not bitmask.any()

    def wait(self, timeout: float) -> None:
        if self.pending:
            cf.wait([f for _, f, _ in self.pending], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def vocab_mask(self, reqs: list[Req], vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """bool [B, V] on `device` (True = allowed) when any row is constrained, else None."""
        from radixlm.constrained import bitmask_to_bool

        mask = self.device_mask(self.fill_masks(reqs, vocab_size, device), vocab_size, device)
        return bitmask_to_bool(mask, vocab_size) if mask is not None and device.type == "cpu" else mask

    def fill_masks(self, reqs: list[Req], vocab_size: int, device: torch.device,
                   wanted: list[bool] | None = None) -> torch.Tensor | None:
        """The rows' masks of allowed next tokens as a packed bitmask [B, W] (a row without a grammar
        allows every token), or None when no row is constrained. On CUDA it is page-locked (the copy is
        asynchronous) and `device_mask` unpacks it on the device; on the CPU the sampler reads it
        packed. Host work only: the scheduler runs it while the step's forward runs.

        A grammar that raises fails only its own request (`finish` set; its row allows everything and
        its token is discarded). `wanted`: the rows whose draw will be read (an overlapped step's rows
        that finished, parked or jumped forward meanwhile are not; they stay all-allowed)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and (wanted is None or wanted[i])]
        if not rows:
            return None
        from radixlm.constrained import allocate_bitmask

        bitmask = self._host_bitmask(len(reqs), vocab_size, device, allocate_bitmask)
        targets = [(t, i) for i in rows if (t := reqs[i].grammar.batch_target()) is not None]
        try:  # the rows' masks at once, in parallel; each grammar's fill_mask finishes its own row
            self.backend.fill_rows(targets, bitmask)
        except Exception as e:  # filled one by one below instead
            logger.warning("filling %d masks at once failed (%s); filling them one by one", len(targets), e)
        for i in rows:
            try:
                reqs[i].grammar.fill_mask(bitmask, i)
            except GrammarError as e:  # the spec cannot judge this output (a bad reference, a slow pattern)
                reqs[i].finish = self._spec_error(reqs[i], e)
                bitmask[i].fill_(-1)
            except Exception as e:
                logger.warning("grammar mask of %s failed: %s", reqs[i].rid, e)
                reqs[i].finish = FinishReason("abort", message=f"grammar error while masking: {e}", code=500)
                bitmask[i].fill_(-1)
        allows = bitmask.any(dim=1).tolist()  # one pass for the batch (a failed row allows everything)
        for i in rows:
            if not allows[i]:  # a dead end (e.g. a schema that recurses without a base case)
                reqs[i].finish = FinishReason("abort", message=f"the {_named(reqs[i])} admits no continuation of "
                                              "this output (nothing can match it from here)", code=400)
                bitmask[i].fill_(-1)
        return bitmask

    @staticmethod
    def device_mask(filled: torch.Tensor | None, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """`fill_masks`' answer as the sampler takes it: on CUDA copied and unpacked to the bool [B, V]
        mask there, on the launching thread, whose stream the sampling runs on; on the CPU as it is."""
        if filled is None or device.type == "cpu":
            return filled
        from radixlm.constrained import bitmask_to_bool

        return bitmask_to_bool(filled.to(device, non_blocking=True), vocab_size)

    def _host_bitmask(self, rows: int, vocab_size: int, device: torch.device, allocate) -> torch.Tensor:
        """An all-allowed bitmask [rows, W]. On CUDA it is a view of one page-locked buffer, so the
        copy to the device is asynchronous with no pinning per step. Reusing it is safe: a step's masks
        are filled only once the step before it is resolved (overlap.py), and that resolve waited for
        its ids, which its stream drew after copying its masks."""
        if device.type != "cuda":
            return allocate(rows, vocab_size)
        if self._pinned is None or self._pinned.shape[0] < rows or self._pinned.shape[1] != (vocab_size + 31) // 32:
            self._pinned = allocate(max(rows, 64), vocab_size).pin_memory()
        view = self._pinned[:rows]
        view.fill_(-1)
        return view

    @staticmethod
    def _field(req: Req) -> str | None:
        return req.params.constraint[0] if req.params.constraint else None

    def _spec_error(self, req: Req, e: GrammarError) -> FinishReason:
        field = self._field(req)
        message = str(e) if str(e).startswith("invalid ") or field is None else f"{field}: {e}"
        return FinishReason("abort", message=message, code=400, field=field)

    def advance(self, req: Req, token: int) -> FinishReason | None:
        grammar = req.grammar
        try:
            accepted = grammar.accept(token)
        except GrammarError as e:
            return self._spec_error(req, e)
        if not accepted:
            why = getattr(grammar, "error_message", None)  # the schema's end check: the request's own problem
            if why:
                return FinishReason("abort", message=f"invalid json_schema: {why}", code=400, field="json_schema")
            # The backend's mask allowed the token and its parser refused it: llguidance does this
            # for specs no finite output can satisfy (a regex needing a byte no token has, a schema
            # that requires itself without end). The spec is the cause, so it is the request's error.
            kind = self._field(req)
            if kind is None:  # token healing's own grammar: ours, not the request's
                return FinishReason("abort", message=f"token {token} rejected by the grammar", code=500)
            text = self.token_bytes[token] if token < len(self.token_bytes) else None
            logger.info("request %s: the %s grammar refused token %d (%r) that its mask allowed", req.rid, kind,
                        token, text)
            return FinishReason("abort", message=f"the {kind} cannot be satisfied from here: its grammar allowed "
                                f"token {text!r} and then refused it (does every path of the {kind} lead to "
                                "an output the model's tokens can spell, in finitely many steps?)",
                                code=400, field=self._field(req))
        if isinstance(grammar, HealingGrammar) and grammar.settled:
            req.grammar = grammar.inner  # healed: the request's own grammar (or none) from here on
        if grammar.is_terminated():
            return FinishReason("stop", matched=token)
        return None

    @staticmethod
    def busy(req: Req):
        """The Future of the request's end-check verdict while it is computed off-thread, else None:
        until it is done the request must take no step (its next mask depends on it)."""
        grammar = req.grammar
        if isinstance(grammar, HealingGrammar):
            grammar = grammar.inner
        pending = getattr(grammar, "pending_check", None)
        future = pending() if pending is not None else None
        return future if future is not None and not future.done() else None

    def jump_forward(self, req: Req) -> int:
        """Appends the forced continuation as natural tokens; returns how many were added.

        The last sampled token has no KV yet, so it can be re-tokenized together with the forced
        string: `{` + `"name` may become `{"` + `name`, as a model would have written it. Text is
        only merged at character boundaries: a last token holding part of a multi-byte character
        (or a forced run ending inside one) means no jump this step; the model writes the rest.
        """
        if not self.jump_forward_enabled or req.return_logprob or req.grammar is None:
            return 0
        last = req.output_ids[-1]
        last_bytes = self.token_bytes[last] if last < len(self.token_bytes) else None
        if not last_bytes:
            return 0
        try:
            last_text = last_bytes.decode("utf-8")
            forced = req.grammar.jump_forward()
        except UnicodeDecodeError:
            return 0
        if not forced or "\ufffd" in forced:
            return 0
        encode, decode = self.codec
        merged = encode(last_text + forced)
        if decode(merged) != last_text + forced:
            return 0
        room = req.params.max_new_tokens - len(req.output_ids) + 1
        if len(merged) - 1 < 1 or len(merged) > room:
            return 0
        if not req.grammar.accept_string(forced):
            return 0
        req.output_ids[-1:] = merged
        req.jump_forward_tokens += len(merged) - 1
        return len(merged) - 1

    @property
    def codec(self) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
        """The tokenizer's encode (no special tokens) and decode, through the fast tokenizer's Rust
        backend when it answers as the wrapper does (the wrapper adds its own work to every call)."""
        if self._codec is None:
            tok = self.tokenizer
            self._codec = (lambda text: tok.encode(text, add_special_tokens=False)), tok.decode
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", True):
                encode = (lambda text: backend.encode(text, add_special_tokens=False).ids)
                decode = (lambda ids: backend.decode(ids, skip_special_tokens=False))
                probe = '{"name": "Zoë", "n": [1, 2.5e-3], "ok": true}\n\t 😀 '
                ids = self._codec[0](probe)
                if encode(probe) == ids and decode(ids) == self._codec[1](ids):
                    self._codec = encode, decode
        return self._codec

    @property
    def token_bytes(self) -> list[bytes | None]:
        if self._token_bytes is None:
            from radixlm.constrained.vocab import token_bytes

            self._token_bytes = token_bytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()


def _named(req: Req) -> str:
    """What constrains the request, as its messages name it."""
    p = req.params
    kind = p.constraint[0] if p.constraint else None
    rules = " and ".join(name for name, on in (("allowed_token_ids", p.allowed_token_ids is not None),
                                               ("bad_words", bool(p.bad_words))) if on)
    if not rules:
        return kind or "token healing"
    return rules if kind is None else f"{kind} under {rules}"
