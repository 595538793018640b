"""The boundary between the interpreter and whatever answers generation calls.

`Backend` is the one interface the interpreter uses. Implementations:
  EngineBackend    (engine_backend.py)   an in-process radixlm.runtime.Engine
  RuntimeEndpoint  (runtime_endpoint.py) a RadixLM server over HTTP (native /generate)
  OpenAI           (openai_backend.py)   any OpenAI-compatible /v1 server
The first two share their generate/select logic in `NativeBackend` (native.py); they differ
only in transport. `as_backend` accepts an Engine directly (no wrapper for users to build).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from radixlm.lang.ir import GenParams


class BackendError(RuntimeError):
    """A backend could not answer (aborted request, HTTP error, malformed reply)."""


@dataclass(frozen=True)
class Prompt:
    """What a backend sees of a program state when it is asked to generate or select.

    `text` is the single source of truth for native backends (the whole state text so far; the
    runtime's radix cache makes resending it cheap). Chat-API backends use `messages` instead,
    plus `role` / `role_text` (the open role, and what was appended inside it so far).
    """

    text: str
    messages: tuple[dict, ...] = ()
    role: str | None = None
    role_text: str = ""


@dataclass
class GenOutput:
    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Base class of backends. Subclasses implement generate, generate_stream, select and
    apply_chat_template; the rest has usable defaults."""

    is_chat_model = False  # True: generates whole assistant messages (OpenAI chat models)

    def __init__(self) -> None:
        self._template: ChatTemplate | None = None
        self._template_lock = threading.Lock()

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: GenParams) -> GenOutput:
        raise NotImplementedError

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict]]:
        """Yield (new text, meta info so far) pieces; the pieces concatenate to the output."""
        out = self.generate(prompt, params)
        yield out.text, out.meta_info

    def select(self, prompt: Prompt, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError

    def cache_prefix(self, prompt: Prompt) -> None:
        """Ask the runtime to cache `prompt`'s text (prefill only, nothing generated). Called at
        `s.fork(n)` so the branches' requests all find the shared prefix in the cache instead
        of racing to compute it. Backends without a prefix cache do nothing."""

    # --- chat template ------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise NotImplementedError

    def _tokenizer_for_template(self) -> Any:
        return None

    @property
    def chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._template is None:
                self._template = ChatTemplate(self.apply_chat_template, self._tokenizer_for_template())
            return self._template

    def get_chat_template(self) -> ChatTemplate:
        """SGLang's backend method: the chat template role blocks use (measured from the model's own
        template, so SGLang's name-based guess from the model path plays no part)."""
        return self.chat_template

    def role_stops(self, role: str) -> tuple[list[str], list[int]]:
        """Stop strings and stop token ids added to a gen inside a `role` block."""
        return self.chat_template.stop_strings(role), self.chat_template.stop_token_ids(role)

    # --- administration -----------------------------------------------------------------
    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def resolve_backend(backend: Any = None) -> Backend:
    """`backend` as a Backend, else the default one (`global_config.default_backend`)."""
    from radixlm.lang.global_config import global_config

    chosen = backend if backend is not None else global_config.default_backend
    if chosen is None:
        raise RuntimeError("no backend: call radixlm.lang.set_default_backend(...) or pass backend=")
    return as_backend(chosen)


_ENGINE_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENGINE_LOCK = threading.Lock()


def as_backend(obj: Any) -> Backend:
    """A Backend for `obj`: a Backend as is, or an Engine(-like object) wrapped once and reused
    (so its measured chat template is shared by every program that uses it)."""
    if isinstance(obj, Backend):
        return obj
    if isinstance(getattr(obj, "endpoint", None), Backend):  # a Runtime: its RuntimeEndpoint
        return obj.endpoint
    if callable(getattr(obj, "generate", None)) and hasattr(obj, "tokenizer"):
        from radixlm.lang.engine_backend import EngineBackend

        with _ENGINE_LOCK:
            try:
                backend = _ENGINE_BACKENDS.get(obj)
                if backend is None:
                    backend = _ENGINE_BACKENDS[obj] = EngineBackend(obj)
            except TypeError:  # not weak-referenceable: wrap without caching
                backend = EngineBackend(obj)
        return backend
    raise TypeError(
        "expected a backend (Engine, RuntimeEndpoint, OpenAI or a radixlm.lang.Backend), "
        f"got {type(obj).__name__}"
    )
