"""K and V gathered from the pool for the CPU attention backends, and kept across decode steps.

A decode reads every key of every row in every layer: at 2,000 tokens of context that is a 3 MB
gather a layer, as long as the rest of the layer's attention. Consecutive decode steps read almost
the same keys, so two things are kept from one step to the next:
- `SharedKV`: the keys every row holds in the same slots (a system prompt, few-shot, n > 1; the
  invariant backend's whole blocks of them), reused while the decodes' shared slots are the same, in
  the layout the backend gathers them into;
- `OwnKV`: each row's keys after them, reused while the decodes run the same rows, each step adding
  its new tokens' K/V (the values it has just written to the pool) instead of gathering again.
Both the invariant backend and the torch backend (on the CPU) keep them.

Both are sound without hooks on frees. A slot's K/V change only when it is written, and every write
(a step's new tokens, a snapshot load) goes to slots just handed out, which nothing held then.
Every row of every decode since a gather held the slots it read, so no decode in between rewrote
them; a slot freed and handed out again reaches a decode's rows only through some request's
extend, and any extend drops both (the backend does). A layer's kept keys are used only if that
layer ran the step just before (so a step that failed half way cannot leave layers out of step),
and at most KEPT_KV_BYTES of each kind are kept: layers past that gather every step. The values are
copies of the pool's, so the answers are the same bits either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 64  # keys per block: the invariant backend's BLOCK
KEPT_KV_BYTES = 256 << 20  # kept K/V per kind (shared, own) at most


def padded(n: int) -> int:
    """`n` keys rounded up to whole blocks (at least one): the widths kept keys are gathered at."""
    return max(1, math.ceil(n / BLOCK)) * BLOCK


def gather(pool, layer: int, index: torch.Tensor, rows: int, kv_heads: int, width: int):
    """K and V as float32 [R, KVH, nb, BLOCK, D] from the pool's rows `index` (`pool_rows`)."""
    k, v = pool.k[layer], pool.v[layer]
    shape = (rows, kv_heads, width // BLOCK, BLOCK, k.shape[-1])
    keys = k.view(-1, k.shape[-1]).index_select(0, index).view(shape)
    values = v.view(-1, v.shape[-1]).index_select(0, index).view(shape)
    return keys.float(), values.float()


def slots(table: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] slots of the rows' keys; columns past the table's width repeat slot 0 (masked)."""
    have = min(width, table.shape[1])
    out = table[rows, :have]
    if have < width:
        out = torch.nn.functional.pad(out, (0, width - have))
    return out


def pool_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Rows of a pool viewed as [slots * KVH, D] for K or V laid out [R, KVH, W, D] (`gather`'s index)."""
    heads = torch.arange(kv_heads)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).view(-1)


class LazyIndex:
    """The rows' own-key index (`pool_rows`) of one decode step, from column `start` to `width`, made on
    the first call: only a layer whose kept keys are missing gathers, and consecutive decodes keep theirs."""

    __slots__ = ("_table", "_rows", "_width", "_start", "_kvh", "_value")

    def __init__(self, table: torch.Tensor, rows: torch.Tensor, width: int, start: int, kv_heads: int):
        self._table, self._rows, self._width, self._start, self._kvh = table, rows, width, start, kv_heads
        self._value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            self._value = pool_rows(slots(self._table, self._rows, self._width)[:, self._start:], self._kvh)
        return self._value


def _room(holder: SharedKV | OwnKV, kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether `holder` may keep `kv` as well within KEPT_KV_BYTES; if so, counts it."""
    size = sum(t.numel() * t.element_size() for t in kv)
    if holder.nbytes + size > KEPT_KV_BYTES:
        return False
    holder.nbytes += size
    return True


@dataclass(slots=True)
class SharedKV:
    """The shared keys' K/V of one decode's index `index` into `pool`, per layer, in the layout the
    backend's `gather(pool, layer, index)` makes (the invariant backend's blocks, the torch backend's
    [1, KVH, L, D])."""

    pool: object
    index: torch.Tensor
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    nbytes: int = 0

    def matches(self, pool, index: torch.Tensor) -> bool:
        return self.pool is pool and torch.equal(self.index, index)

    def get(self, layer: int, gather: Callable[[object, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.layers.get(layer)
        if kv is None:
            kv = gather(self.pool, layer, self.index)
            if _room(self, kv):
                self.layers[layer] = kv
        return kv


@dataclass(slots=True)
class Kept:
    """One layer's own K/V of a decode ([R, KVH, nb, BLOCK, D]) with the views a step reads and writes,
    made once per gather rather than in every layer of every step (a view costs a microsecond or two,
    and a decode layer is a few dozen microseconds)."""

    keys: torch.Tensor
    values: torch.Tensor
    step: int  # the decode step that last ran this layer on them
    key_rows: torch.Tensor  # [R * KVH * width, D]: where a new token's K goes
    value_rows: torch.Tensor
    keys_t: torch.Tensor  # [R * KVH * nb, D, BLOCK]: each block's keys transposed, for the score product
    value_blocks: torch.Tensor  # [R * KVH * nb, BLOCK, D]: for the value product

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, step: int) -> Kept:
        d, blk = keys.shape[-1], keys.shape[-2]
        return cls(keys, values, step, keys.view(-1, d), values.view(-1, d), keys.view(-1, blk, d).transpose(1, 2),
                   values.view(-1, blk, d))


@dataclass(slots=True)
class OwnKV:
    """The rows' own keys ([R, KVH, nb, BLOCK, D], from position `start` to `start + width`) of one set of
    rows (`req_rows`, in batch order) in `pool`, per layer, with the decode step each layer last ran."""

    pool: object
    req_rows: torch.Tensor
    start: int
    width: int
    layers: dict[int, Kept]
    nbytes: int = 0

    def matches(self, pool, req_rows: torch.Tensor, start: int, width: int) -> bool:
        return (self.pool is pool and self.start == start and self.width == width
                and torch.equal(self.req_rows, req_rows))

    def get(self, pool, layer: int, step: int, index: Callable[[], torch.Tensor], kv_heads: int,
            new_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Kept:
        """This step's keys and values: the kept ones with the new tokens (`k`, `v` [R, KVH, D]) written in
        at `new_rows` [R * KVH] (rows of the kept tensors seen as [R * KVH * width, D], see `row_starts`),
        if this layer ran step `step - 1` on them; else a gather of the pool's rows `index()` (made only
        when a layer gathers)."""
        kept = self.layers.get(layer)
        if kept is not None and kept.step == step - 1:
            d = k.shape[-1]
            # as the pool holds them: written in its dtype, read back as float32 (one flat copy per kind:
            # a third of an indexed assignment's cost)
            kept.key_rows.index_copy_(0, new_rows, _as_pool(k.reshape(-1, d), pool.k[layer].dtype))
            kept.value_rows.index_copy_(0, new_rows, _as_pool(v.reshape(-1, d), pool.v[layer].dtype))
            kept.step = step
            return kept
        keys, values = gather(pool, layer, index(), self.req_rows.numel(), kv_heads, self.width)
        fresh = Kept.of(keys, values, step)
        if kept is None and not _room(self, (keys, values)):  # one out of step was counted already
            return fresh
        self.layers[layer] = fresh
        return fresh


def _as_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded as a pool of `dtype` holds it, as float32 (the kept keys' dtype)."""
    return x if x.dtype == dtype == torch.float32 else x.to(dtype).float()


def row_starts(rows: int, kv_heads: int, width: int) -> torch.Tensor:
    """[R, KVH]: each row's first row per head in kept keys [R, KVH, width, D] seen as [R * KVH * width, D];
    a new token at column c (counted from OwnKV.start) goes to `row_starts + c`."""
    return torch.arange(rows * kv_heads).view(rows, kv_heads) * width


def blocked(mask: torch.Tensor) -> torch.Tensor:
    """[..., W] -> [..., nb, BLOCK]."""
    return mask.view(*mask.shape[:-1], mask.shape[-1] // BLOCK, BLOCK)
