"""Process-wide settings of the language, SGLang's `global_config` (same fields, same defaults).

    from radixlm.lang import global_config
    global_config.verbosity = 2          # print each program's final text after run()

Fields:
  verbosity                            0: quiet; >= 2: print the state text when a run() ends
  default_backend                      what `set_default_backend` sets (an Engine, a backend...)
  skip_special_tokens_in_output        sent with every gen as sampling param skip_special_tokens
  spaces_between_special_tokens_in_out sent as spaces_between_special_tokens
  enable_precache_with_tracing         run_batch first caches the program's constant prefix, found
                                       by tracing it (Function.trace), when it is over 64 chars
  enable_parallel_encoding             accepted for compatibility; fork joins always concatenate
                                       text (the radix cache reuses the branches' KV anyway)
"""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    def __init__(self) -> None:
        self.verbosity = 0
        self.default_backend: Any = None
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True


global_config = GlobalConfig()

__all__ = ["GlobalConfig", "global_config"]
