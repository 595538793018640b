"""KV storage: token-granular slots (page size 1), the slot allocator and the req -> token table.

A *slot* holds the K and V of one token in every layer. The radix cache owns the slots of cached
prefixes; a running request owns the slots of its own uncached tokens. Everything that frees a
slot goes through `SlotAllocator.free`, which refuses double frees so leaks and aliasing show up
in tests instead of as wrong answers.

Both pools keep one spare entry past what the allocators hand out: `KVPool.dummy_slot` and
`ReqToTokenPool.dummy_row`, whose every position maps to the dummy slot. The CUDA-graph runner
pads a decode batch up to its bucket with rows that write and read only these, so padding never
touches a request's KV; pool sizes and accounting (free + cached + held = num_slots) leave them out.
"""

from __future__ import annotations

import torch

from radixlm.runtime.executor import host_memory


class OutOfSlotsError(RuntimeError):
    pass


class SlotAllocator:
    """Free list over slot ids [0, num_slots), first freed first out. A request's slots come out as
    long runs of consecutive ids, which its attention then reads in order: handing recently freed
    slots out first (which would keep a lazily mapped CPU pool's touched pages fewer) would scatter
    them and slow every batch's attention reads.

    Freed slots queue in `_freed` and join the list only when an allocation needs them: appending
    each free to one tensor would copy the whole free list every time (milliseconds per free on a
    pool of millions of slots). Each slot is copied once per trip through the list. The list's first
    `_head` entries were handed out: an allocation is one slice of it (a decode step's dispatches
    cost microseconds each)."""

    def __init__(self, num_slots: int, debug: bool = False):
        self.num_slots = num_slots
        self.debug = debug
        self._free = torch.arange(num_slots, dtype=torch.int64)
        self._head = 0  # _free[_head:] are free
        self._freed: list[torch.Tensor] = []  # freed since the last merge, in order
        self._freed_n = 0
        self._is_free = torch.ones(num_slots, dtype=torch.bool) if debug else None

    @property
    def num_free(self) -> int:
        return self._free.numel() - self._head + self._freed_n

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._free.numel() - self._head:
            if n > self.num_free:
                raise OutOfSlotsError(f"asked for {n} KV slots, {self.num_free} free")
            self._merge()
        start = self._head
        self._head = start + n
        out = self._free[start : start + n]
        if self._is_free is not None:
            self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).cpu()
        if self._is_free is not None:
            if bool(self._is_free[slots].any()) or slots.unique().numel() != slots.numel():
                raise RuntimeError("double free of KV slots")
            self._is_free[slots] = True
        self._freed.append(slots.flatten().clone())  # the caller's tensor may be a view it reuses
        self._freed_n += slots.numel()

    def _merge(self) -> None:
        self._free = torch.cat([self._free[self._head :], *self._freed])
        self._head = 0
        self._freed, self._freed_n = [], 0

    def free_mask(self) -> torch.Tensor:
        """[num_slots] bool: which slots are free now."""
        mask = torch.zeros(self.num_slots, dtype=torch.bool)
        for part in (self._free[self._head :], *self._freed):
            mask[part] = True
        return mask

    def reset(self) -> None:
        self._free = torch.arange(self.num_slots, dtype=torch.int64)
        self._head = 0
        self._freed, self._freed_n = [], 0
        if self._is_free is not None:
            self._is_free.fill_(True)


class KVPool:
    """Per-layer K and V tensors of shape [num_slots + 1, kv_heads, head_dim]; the last is the dummy slot."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots = num_slots
        self.dummy_slot = num_slots  # past the allocator's range: never handed to a request
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [host_memory.zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [host_memory.zeros(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_ is several times cheaper than advanced-index assignment on CPU
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))


class ReqToTokenPool:
    """Row r maps positions of the request holding row r to their KV slots.

    The scheduler reads and writes the host table (bookkeeping never waits on the device); the
    attention backends read `device_table`. On the CPU both are one tensor. Elsewhere, writes of
    cached-prefix slots are queued and shipped with the next batch (`take_pending`), and new
    tokens' slots reach the device inside the batch itself (`mirror=False`).

    Row `dummy_row` (= max_requests, never allocated) maps every position to `dummy_slot`: the
    pool's `KVPool.dummy_slot` wherever a graph runner pads batches (the default 0 suits tables
    that never see padding rows).
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device, dummy_slot: int = 0):
        self.host = torch.zeros((max_requests + 1, max_context), dtype=torch.int64)
        self.dummy_row = max_requests
        self.host[self.dummy_row] = dummy_slot
        self.shared = device.type == "cpu"
        self.device_table = self.host if self.shared else self.host.to(device)
        self.flat = self.host.view(-1)  # the host table flat (index r * max_context + p): one op per write fewer
        self._free_rows = list(range(max_requests))
        self.max_requests = max_requests
        self.max_context = max_context
        self._pending: list[tuple[int, torch.Tensor]] = []  # (flat start, slots) not yet on the device
        # bumped whenever a slot a row already holds may change (a row handed out or back, a write of
        # its prompt's or cached slots); a decode step's new-token writes keep it: they only append
        self.version = 0
        self.shared_memo: tuple[int, tuple[int, ...], int] | None = None  # forward_batch's (version, rows, n)

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfSlotsError("no free request rows")
        self.version += 1
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self.version += 1
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor, mirror: bool = True) -> None:
        """Host write; `mirror=False` when the slots are new tokens of the next batch."""
        self.version += 1
        slots = host_memory.as_int64(slots)
        self.host[row, start : start + slots.numel()] = slots
        if mirror and not self.shared and slots.numel():
            self._pending.append((row * self.max_context + start, slots.clone()))

    def write_tokens(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """One new token per row (a decode step); the batch carries them to the device."""
        flat = host_memory.int64s([r * self.max_context + p for r, p in zip(rows, positions)])
        self.flat.index_copy_(0, flat, host_memory.as_int64(slots))  # one op: half an indexed assignment's time

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat table positions and slot values written on the host since the last call."""
        if not self._pending:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        idx = torch.cat([torch.arange(s, s + v.numel()) for s, v in self._pending])
        val = torch.cat([v for _, v in self._pending])
        self._pending = []
        return idx, val

    def read(self, row: int, end: int) -> torch.Tensor:
        return self.host[row, :end]
