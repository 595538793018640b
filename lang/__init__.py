"""RadixLM's structured-generation language (SGLang-compatible frontend).

    import radixlm.lang as rl

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    rl.set_default_backend(rl.Engine(model="smollm2-135m"))
    print(qa.run(question="What is 2+2?")["answer"])

Modules: ir (IR nodes), interpreter (per-state worker thread), state (ProgramState, forks),
api (gen, select, roles), function (@function, run, run_batch, trace), tracer, speculative (API
speculative execution), global_config, choices (select scoring), chat_template (role strings),
backend / native / engine_backend / runtime_endpoint / openai_backend (backends), server_runtime
(Runtime: a server launched from Python).
"""

from typing import Any

from radixlm.lang.api import (
    Function,
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.backend import Backend, BackendError, GenOutput, Prompt, as_backend
from radixlm.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.engine_backend import EngineBackend
from radixlm.lang.global_config import GlobalConfig, global_config
from radixlm.lang.native import NativeBackend
from radixlm.lang.openai_backend import OpenAI, TokenUsage
from radixlm.lang.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.state import ForkedStates, ProgramState
from radixlm.lang.tracer import TracerProgramState

__all__ = [
    "Backend", "BackendError", "ChoicesDecision", "ChoicesSamplingMethod", "Engine", "EngineBackend",
    "ForkedStates", "Function", "GenOutput", "GlobalConfig", "NativeBackend", "OpenAI", "ProgramState", "Prompt",
    "Runtime", "RuntimeEndpoint", "TokenUsage", "TracerProgramState", "as_backend", "assistant", "assistant_begin",
    "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end", "video",
]


def __getattr__(name: str) -> Any:
    # The runtime imports torch; load it only when a program asks for the Engine.
    if name == "Engine":
        from radixlm.runtime import Engine

        return Engine
    raise AttributeError(f"module 'radixlm.lang' has no attribute {name!r}")
