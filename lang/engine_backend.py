"""Backend over an in-process `radixlm.runtime.Engine` (or any object with its interface).

Users never build this: `set_default_backend(engine)` and `run(backend=engine)` wrap an Engine
through `as_backend`. Engine.generate is thread-safe, and concurrent calls (fork branches,
run_batch items) are batched together by the engine's scheduler.
"""

from __future__ import annotations

from typing import Any

from radixlm.lang.native import NativeBackend


class EngineBackend(NativeBackend):
    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine

    def _generate_raw(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                      logprob_start_len=-1, top_logprobs_num=0, stream=False, return_text_in_logprobs=False) -> Any:
        # the Engine returns logprob entries without text: NativeBackend fills it (decode_token)
        return self.engine.generate(
            prompt=prompt,
            sampling_params=sampling_params,
            input_ids=input_ids,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            stream=stream,
        )

    def streams_incrementally(self) -> bool:
        return bool(getattr(getattr(self.engine, "server_args", None), "incremental_streaming_output", False))

    def tokenize(self, text: str) -> list[int] | None:
        return list(self.engine.tokenizer.encode(text))

    def decode_token(self, token_id: int) -> str | None:
        return self.engine.tokenizer.decode([token_id])

    def bos_token_id(self) -> int | None:
        return getattr(self.engine.tokenizer, "bos_token_id", None)

    def _tokenizer_for_template(self) -> Any:
        return self.engine.tokenizer

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        self.engine.shutdown()
