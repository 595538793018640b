"""The entry point of the server's child processes: `run("module:function", *args)`.

The HTTP process names a child's main function as a string, so it can start the scheduler before it
imports torch or the runtime itself (`children.start_children`): a `spawn` child's target is pickled
by reference, and referencing `scheduler_process.run_scheduler_process` would import the runtime
first. Tests name their own functions here to wrap a child's main. A child of
`torch_free.CHILD_MODULES` blocks torch before its module loads.

A child that returns exits without the interpreter's finalization: its atexit handlers run and its
output is flushed, but the collection of every module's objects that finalization does is skipped:
the server's stop and a child's restart would wait for it."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys

from radixlm.server import torch_free


def run(entry: str, *args) -> None:
    module, name = entry.split(":")
    if module in torch_free.CHILD_MODULES:
        torch_free.block_torch()
    code = 0
    try:
        getattr(importlib.import_module(module), name)(*args)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # a message: printed, and the exit code is 1, as the interpreter would
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
