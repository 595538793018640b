"""One step's flat batch description: built once on the host, moved to the model's device in one copy.

The scheduler says what runs (a `BatchPlan` of host lists); `ForwardBatch.build` packs it into a
single int64 host buffer (pinned on CUDA), copies it to the device once, and derives the rest there:

    input_ids, positions, out_cache_loc            [T]    one row per new token
    req_rows, prefix_lens, seq_lens                [B]    per request (rows of the req->token table)
    qo_indptr, kv_indptr                           [B+1]  CSR offsets of new tokens / all KV tokens
    kv_indices                                     [K]    CSR over the req->token table: slots of
                                                          every request's tokens, in order
    logits_indices                                 [L]    rows of the hidden states that get logits

Nothing is per request and nothing is per layer: an attention backend plans once per step in
`init_forward_metadata` from these tensors (and the host copies of the lengths, so planning never
waits on the device) and serves every layer from that plan.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.executor.host_memory import as_int64, int64s
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool

CASCADE_MIN_SHARED = 64  # shared-prefix tokens from which one shared attention pass pays off


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens (a prompt or a chunk of one) after an optional cached prefix
    DECODE = "decode"  # exactly one new token per request


@dataclass(slots=True)
class BatchPlan:
    """What the scheduler runs in one step, as host values (filled by the scheduler)."""

    mode: ForwardMode
    input_ids: list[int]  # [T] new tokens of all requests, request after request
    # int64 [T] on the CPU: the slot receiving each new token's K/V (a decode plan's are written into
    # the req->token table by `ForwardBatch.build`, at each row's prefix length)
    out_cache_loc: torch.Tensor
    req_rows: list[int]  # [B] req->token table row of each request
    prefix_lens: list[int]  # [B] tokens whose KV is in the pool before this step
    extend_lens: list[int]  # [B] new tokens (1 per request in decode)
    logits_indices: list[int]  # rows of the [T, hidden] output that get logits


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    # device tensors (int64)
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    logits_indices: torch.Tensor
    # host copies for planning without a device sync
    seq_lens_host: list[int]
    extend_lens_host: list[int]
    shared_prefix_len: int  # leading KV slots every request of the batch shares (0 = none or too short)
    kv_pool: KVPool
    req_to_token: torch.Tensor  # the device table [rows, max_context]
    attn_metadata: Any = None  # filled by the attention backend's init_forward_metadata
    _kv_indices: torch.Tensor | None = None  # see kv_indices

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def kv_indices(self) -> torch.Tensor:
        """[K] slots of every request's tokens, request after request (CSR by kv_indptr).

        Built on first use: a decode step on the torch backend reads keys straight from the
        req->token table and never needs it (it is 0.1-0.2 ms of host time at batch 64)."""
        if self._kv_indices is None:
            total = sum(self.seq_lens_host)  # kv_indptr[-1], known on the host
            seq = self.seq_lens
            kv_rows = torch.repeat_interleave(self.req_rows, seq, output_size=total)
            starts = torch.repeat_interleave(self.kv_indptr[:-1], seq, output_size=total)
            self._kv_indices = self.req_to_token[kv_rows, torch.arange(total, device=seq.device) - starts]
        return self._kv_indices

    @classmethod
    def build(cls, plan: BatchPlan, req_to_token: ReqToTokenPool, kv_pool: KVPool,
              device: torch.device) -> ForwardBatch:
        b, t = len(plan.req_rows), len(plan.input_ids)
        if not (b == len(plan.prefix_lens) == len(plan.extend_lens)) or sum(plan.extend_lens) != t:
            raise ValueError("inconsistent batch plan: per-request lists differ or extend_lens != tokens")
        decode = plan.mode is ForwardMode.DECODE
        if decode and req_to_token.shared and device.type == "cpu":
            return cls._host_decode(plan, req_to_token, kv_pool)
        if decode:  # the host table's copy of the new tokens' slots (the device's is written below)
            req_to_token.write_tokens(plan.req_rows, plan.prefix_lens, plan.out_cache_loc)
        # the host lists in one tensor: each torch.tensor call costs microseconds of its own
        host = int64s(plan.input_ids + plan.req_rows + plan.prefix_lens + plan.extend_lens + plan.logits_indices)
        ids, rows, prefix, extend, logit_rows = host.split([t, b, b, b, len(plan.logits_indices)])
        seq = prefix + extend
        seq_host = [p + n for p, n in zip(plan.prefix_lens, plan.extend_lens)]
        kv_indptr = _indptr(seq)
        if decode:  # one new token per request, at its prefix length
            qo_indptr, positions = torch.arange(b + 1), prefix
        else:  # new token i of request r sits at prefix_r + i
            qo_indptr = _indptr(extend)
            positions = torch.repeat_interleave(prefix - qo_indptr[:-1], extend, output_size=t) + torch.arange(t)
        write_idx, write_val = req_to_token.take_pending()
        parts = [ids, positions, as_int64(plan.out_cache_loc), rows, prefix, seq, qo_indptr, kv_indptr,
                 logit_rows, write_idx, write_val]
        if device.type == "cpu":  # the host tensors are the device's: nothing to pack for a copy
            ids, pos, out_loc, rows, prefix_d, seq_d, qo_d, kv_d, logit_d, w_idx, w_val = parts
        else:
            sizes = [int(p.numel()) for p in parts]
            flat = torch.cat(parts)
            if device.type == "cuda":
                flat = flat.pin_memory().to(device, non_blocking=True)
            else:
                flat = flat.to(device)
            (ids, pos, out_loc, rows, prefix_d, seq_d, qo_d, kv_d, logit_d, w_idx, w_val) = flat.split(sizes)

        table = req_to_token.device_table
        if w_idx.numel():
            table.view(-1).index_copy_(0, w_idx, w_val)
        if not req_to_token.shared:  # on the CPU the host table already holds the new slots
            token_rows = rows if decode else torch.repeat_interleave(rows, qo_d[1:] - qo_d[:-1], output_size=t)
            table[token_rows, pos] = out_loc
        return cls(
            mode=plan.mode, input_ids=ids, positions=pos, out_cache_loc=out_loc, req_rows=rows,
            prefix_lens=prefix_d, seq_lens=seq_d, qo_indptr=qo_d, kv_indptr=kv_d, logits_indices=logit_d,
            seq_lens_host=seq_host, extend_lens_host=list(plan.extend_lens),
            shared_prefix_len=_shared_prefix_len(req_to_token, plan),
            kv_pool=kv_pool, req_to_token=table,
        )

    @classmethod
    def _host_decode(cls, plan: BatchPlan, req_to_token: ReqToTokenPool, kv_pool: KVPool) -> ForwardBatch:
        """`build` for a decode step on the CPU, where the host table is the device's: every length and
        offset is summed in Python and the batch is one host tensor, the new tokens' places in the
        req->token table included (a small decode step's host time is mostly per-op dispatch, so
        one host tensor in place of a tensor per field cuts it to about a third at batch 1)."""
        b = len(plan.req_rows)
        seq_host = [p + 1 for p in plan.prefix_lens]
        kv_indptr = [0, *itertools.accumulate(seq_host)]
        width = req_to_token.max_context
        table_at = [r * width + p for r, p in zip(plan.req_rows, plan.prefix_lens)]
        host = int64s(plan.input_ids + plan.req_rows + plan.prefix_lens + seq_host + kv_indptr
                      + list(range(b + 1)) + plan.logits_indices + table_at)
        # split_with_sizes: Tensor.split's Python wrapper costs as much as the split itself
        ids, rows, prefix, seq, kv, qo, logits, at = host.split_with_sizes([b, b, b, b, b + 1, b + 1,
                                                                             len(plan.logits_indices), b])
        out_loc = as_int64(plan.out_cache_loc)
        req_to_token.flat.index_copy_(0, at, out_loc)
        return cls(
            mode=plan.mode, input_ids=ids, positions=prefix, out_cache_loc=out_loc,
            req_rows=rows, prefix_lens=prefix, seq_lens=seq, qo_indptr=qo, kv_indptr=kv, logits_indices=logits,
            seq_lens_host=seq_host, extend_lens_host=list(plan.extend_lens),
            shared_prefix_len=_shared_prefix_len(req_to_token, plan),
            kv_pool=kv_pool, req_to_token=req_to_token.device_table,
        )


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def _shared_prefix_len(req_to_token: ReqToTokenPool, plan: BatchPlan) -> int:
    """Leading slots all requests share (they do exactly when the radix cache gave them the same
    prefix). Only KV already in the pool counts: a request's new tokens have fresh slots.

    Rows that differed at position n < min(prefix_lens) still differ there a decode step later, as
    long as no row was handed out, given back or rewritten (the pool's version): consecutive decode
    steps of the same rows reuse the answer instead of comparing the table again."""
    if len(plan.req_rows) < 2:
        return 0
    limit = min(plan.prefix_lens)
    if limit < CASCADE_MIN_SHARED:
        return 0
    key = tuple(plan.req_rows)
    memo = req_to_token.shared_memo
    if memo is not None and memo[0] == req_to_token.version and memo[1] == key:
        return memo[2]
    n = _compare_rows(req_to_token.host, plan.req_rows, limit)
    shared = n if n >= CASCADE_MIN_SHARED else 0
    # n == limit: the rows agree as far as they go; the next step's longer rows are compared again
    req_to_token.shared_memo = (req_to_token.version, key, shared) if n < limit else None
    return shared


def _compare_rows(host_table: torch.Tensor, req_rows: list[int], limit: int) -> int:
    """How many leading positions (up to `limit`) the rows' slots agree on."""
    rows = int64s(req_rows)
    # shared prefixes are prefixes: when the rows already differ at the shortest length that pays
    # off (the usual decode batch of unrelated requests), nothing longer needs comparing
    probe = host_table[rows, CASCADE_MIN_SHARED - 1]
    if not bool((probe == probe[0]).all()):
        return CASCADE_MIN_SHARED - 1  # (or fewer: below the threshold either way)
    block = host_table[rows, :limit]
    same = (block == block[:1]).all(0)
    return limit if bool(same.all()) else int(same.to(torch.int8).argmin())
