"""The serving runtime: model, KV pool, radix cache, scheduler, sampler and the in-process Engine."""

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.server_args import ServerArgs


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it on first use only
    if name == "Engine":
        from radixlm.runtime.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams", "ServerArgs"]
