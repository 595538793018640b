"""The serving runtime: model, KV pool, radix cache, scheduler, sampler and the in-process Engine."""

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.request.params import SamplingParams


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it on first use only
    if name == "Engine":
        from radixlm.runtime.engine import Engine

        return Engine
    # the HTTP server's options (the engine's and its own) kept their old import path
    if name == "ServerArgs":
        from radixlm.server.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)


__all__ = ["Engine", "EngineArgs", "SamplingParams"]
