"""The server's processes that never import torch: the HTTP process and the detokenizer.

Neither computes with tensors: the HTTP process validates, tokenizes and streams; the detokenizer
decodes. But transformers imports torch whenever it is installed, though its tokenizers need none of
it, and torch costs a process ~150 MiB and a second of start-up (benchmarks/README.md, "Server
start-up and memory"). So these processes block the import before loading anything else: an import
of torch then raises ImportError (a test holds that none happens) and transformers takes torch as
absent. A process that has torch already (a test running the app in-process) keeps it.
"""

from __future__ import annotations

import os
import sys

# child processes (server/child_main.py) that run without torch, by their module
CHILD_MODULES = frozenset({"radixlm.server.detokenizer_process"})


def block_torch() -> None:
    if "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # the import system's mark for "cannot be imported"
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # transformers' notice that torch is missing
