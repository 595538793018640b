"""The decode arithmetic of the batch-invariant attention backend (invariant_backend.py): one query
position per row, against its keys in blocks of BLOCK, alone (`decode`) or behind blocks every row
of the step shares (`decode_shared`). It is the extend's arithmetic in the extend's order (the
backend's docstring says which); these functions only lay it out for a decode's few query rows,
with as few ops and views as a short layer allows. A step's buffers and views are made once per step
(`Scratch`) and kept across the decodes of the same rows (`Frame`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.executor.attention import decode_kv


class Scratch:
    """A decode step's buffers, and the views of them each layer reads and writes: made once per step
    (`init_forward_metadata`), so that a layer's arithmetic is its ops alone. A view or an allocation
    costs a microsecond or two, and a dozen of them per layer would be about a quarter of a one-row
    decode's attention.

    `queries` [R, KVH, nb, M, D] holds the layer's queries once per block (`per_block`; the layer
    writes it), `hidden` [R, 1, nb, 1, BLOCK] marks keys past each row's length, `group` is how many
    of the M rows are queries (the rest are zero rows that make up the products' least row count)."""

    __slots__ = ("q", "hidden", "scores", "p", "top", "parts", "den", "blocks", "cum_parts", "cum_den", "total",
                 "den_g")

    def __init__(self, queries: torch.Tensor, hidden: torch.Tensor, group: int):
        r, kvh, nb, m, d = queries.shape
        blk = hidden.shape[-1]
        self.q = queries.view(-1, m, d)
        self.hidden = hidden
        self.scores = queries.new_empty(r * kvh * nb, m, blk)
        self.p = self.scores.view(r, kvh, nb, m, blk)
        self.top = queries.new_empty(r, kvh, 1, m, 1)
        self.parts = queries.new_empty(r * kvh * nb, m, d)
        self.den = queries.new_empty(r, kvh, nb, m)
        if nb == 1:  # one block: its sums are what the cumsums below give
            self.blocks = self.cum_parts = self.cum_den = None
            total, den = self.parts.view(r, kvh, m, d), self.den.view(r, kvh, m)
        else:
            self.blocks = self.parts.view(r, kvh, nb, m, d)
            self.cum_parts = queries.new_empty(r, kvh, nb, m, d)
            self.cum_den = queries.new_empty(r, kvh, nb, m)
            total, den = self.cum_parts[:, :, -1], self.cum_den[:, :, -1]
        self.total = total[:, :, :group]  # [R, KVH, G, D]
        self.den_g = den[:, :, :group, None]


@dataclass(slots=True)
class Frame:
    """What consecutive decode steps of the same rows and key width (one `decode_kv.OwnKV`) reuse, so
    that a step's plan is two small ops: `cols` (positions start..width), `hidden` [R, W] rewritten each
    step and its blocked view [R, 1, nb, 1, BLOCK], the per-block queries [R, KVH, nb, M, D] and their
    view a layer writes (`scaled`, the first G rows), each row's first kept row per head
    (`decode_kv.row_starts`) and the decode's scratch (None behind shared blocks: `decode_shared`)."""

    own: decode_kv.OwnKV
    cols: torch.Tensor
    hidden: torch.Tensor
    blocked: torch.Tensor
    queries: torch.Tensor
    scaled: torch.Tensor
    heads: torch.Tensor
    scratch: Scratch | None

    @classmethod
    def new(cls, own: decode_kv.OwnKV, rows: int, kv_heads: int, group: int, min_rows: int, head_dim: int) -> Frame:
        hidden = torch.empty(rows, own.width, dtype=torch.bool)
        blocked = decode_kv.blocked(hidden)[:, None, :, None]
        # rows past the group stay zero: each layer writes the first `group` of each block's rows
        queries = torch.zeros(rows, kv_heads, own.width // decode_kv.BLOCK, max(group, min_rows), head_dim)
        scratch = Scratch(queries, blocked, group) if own.start == 0 else None
        return cls(own, torch.arange(own.start, own.start + own.width), hidden, blocked, queries,
                   queries[:, :, :, :group], decode_kv.row_starts(rows, kv_heads, own.width), scratch)


def decode_into(s: Scratch, keys_t: torch.Tensor, value_blocks: torch.Tensor, out: torch.Tensor) -> None:
    """One query position per row, into `out` [R, KVH, G, D]: the queries in `s.q` against keys_t
    [R * KVH * nb, D, BLOCK] and value_blocks [R * KVH * nb, BLOCK, D] (decode_kv.Kept). One product
    per block, each of inner size D (columns do not change a score); the blocks' sums are added in block
    order by `cumsum`, one sequential loop in double. These bmm calls are the ones `torch.matmul` makes
    of the same shapes, without its broadcasting and reshapes."""
    torch.bmm(s.q, keys_t, out=s.scores)
    s.p.masked_fill_(s.hidden, float("-inf"))
    torch.amax(s.p, dim=(2, 4), keepdim=True, out=s.top)  # a max is exact in any order
    s.p.sub_(s.top).exp2_()
    torch.bmm(s.scores, value_blocks, out=s.parts)
    torch.sum(s.p, -1, out=s.den)
    if s.blocks is not None:
        torch.cumsum(s.blocks, 2, out=s.cum_parts)
        torch.cumsum(s.den, 2, out=s.cum_den)
    torch.div(s.total, s.den_g, out=out)


def decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
           group: int | None = None) -> torch.Tensor:
    """`decode_into` with its scratch made here (the start-up probe, tests): q [R, KVH, nb, M, D]
    (scaled, `per_block`), keys/values [R, KVH, nb, BLOCK, D] (contiguous), hidden [R, 1, nb, 1, BLOCK]
    -> [R, KVH, G, D], G = `group` (default M)."""
    r, kvh, nb, m, d = q.shape
    g = m if group is None else group
    out = q.new_empty(r, kvh, g, d)
    blk = keys.shape[3]
    decode_into(Scratch(q, hidden, g), keys.view(-1, blk, d).transpose(1, 2), values.view(-1, blk, d), out)
    return out


def per_block(q: torch.Tensor, blocks: int) -> torch.Tensor:
    """q [R, KVH, M, D] -> [R, KVH, blocks, M, D], as `decode` takes it."""
    r, kvh, m, d = q.shape
    return q.unsqueeze(2).expand(r, kvh, blocks, m, d).contiguous()


def _divide(total: torch.Tensor, den: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """total [R, KVH, M, D] / den [R, KVH, M], whole, or its first G rows into `out` [R, KVH, G, D]."""
    if out is None:
        return total / den[..., None]
    g = out.shape[2]
    torch.div(total[:, :, :g], den[:, :, :g, None], out=out)
    return out.view(out.shape[0], -1, out.shape[-1])


def decode_shared(q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`decode` with the leading blocks shared by every row ([KVH, s, BLOCK, D], all visible) scored
    for all rows in one product per block: the same numbers (a row's products do not depend on the
    rows beside it), each block's keys read once instead of once per row. q [R, KVH, nb, M, D] per
    block of the rows' own keys (`per_block`)."""
    r, kvh, _, m, d = q.shape
    s = shared_k.shape[1]
    rows = q[:, :, 0].transpose(0, 1).reshape(kvh, 1, r * m, d)
    ss = torch.matmul(rows, shared_k.transpose(-1, -2))  # [KVH, s, R * M, BLOCK]
    nb, blk = keys.shape[2], keys.shape[3]
    so = torch.bmm(q.reshape(-1, m, d), keys.reshape(-1, blk, d).transpose(1, 2)).view(r, kvh, nb, m, blk)
    so.masked_fill_(hidden, float("-inf"))
    top = torch.maximum(ss.amax(dim=(1, 3)).view(kvh, r, m).transpose(0, 1), so.amax(dim=(2, 4)))  # [R, KVH, M]
    ps = ss.sub_(top.transpose(0, 1).reshape(kvh, 1, r * m, 1)).exp2_()
    po = so.sub_(top[:, :, None, :, None]).exp2_()
    den = torch.cat([ps.sum(-1).view(kvh, s, r, m).permute(2, 0, 1, 3), po.sum(-1)], dim=2).cumsum(2)[:, :, -1]
    parts = torch.cat([torch.matmul(ps, shared_v).view(kvh, s, r, m, d).permute(2, 0, 1, 3, 4),
                       torch.matmul(po, values)], dim=2)
    return _divide(parts.cumsum(2)[:, :, -1], den, out)
