"""The entry point of the server's child processes: `run("module:function", *args)`.

The HTTP process names a child's main function as a string, so it can start the scheduler before it
imports torch or the runtime itself (`children.start_children`): a `spawn` child's target is pickled
by reference, and referencing `scheduler_process.run_scheduler_process` would import the runtime
first. Tests name their own functions here to wrap a child's main. A child of
`torch_free.CHILD_MODULES` blocks torch before its module loads."""

from __future__ import annotations

import importlib

from radixlm.server import torch_free


def run(entry: str, *args) -> None:
    module, name = entry.split(":")
    if module in torch_free.CHILD_MODULES:
        torch_free.block_torch()
    getattr(importlib.import_module(module), name)(*args)
