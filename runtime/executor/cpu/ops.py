"""Calling torch's packed-weight ops (fbgemm's int8 and fp16 linears) without Python's overhead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def direct_op(overload: Any) -> Callable:
    """The C++ entry of an op overload. An op that takes packed weights (a TorchBind object) is called
    through a Python wrapper that first scans its arguments for fake objects (tracing only): ~2 us
    per call, ~120 calls per decode step."""
    return getattr(overload, "_op", overload)


# torch asks every argument of an op that is neither a tensor nor a plain Python value for
# `__torch_function__`; a TorchBind object (fbgemm's packed weights) answers with a C++ exception, thrown
# and caught on every call, about half of a one-row product's time. With subclass dispatch off the
# question is not asked (our tensors are plain: nothing else changes).
no_subclass_dispatch = torch._C.DisableTorchFunctionSubclass
