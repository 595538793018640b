"""The decode arithmetic of the batch-invariant attention backend (invariant_backend.py): one query
position per row, against its keys in blocks of BLOCK, alone (`decode`) or behind blocks every row
of the step shares (`decode_shared`). It is the extend's arithmetic in the extend's order (the
backend's docstring says which); these functions only lay it out for a decode's few query rows,
with as few ops and views as a short layer allows."""

from __future__ import annotations

import torch


def decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """One query position per row. q [R, KVH, nb, M, D] (scaled, the same for each block; M >=
    min_rows; `per_block`), keys/values [R, KVH, nb, BLOCK, D] (contiguous), hidden
    [R, 1, nb, 1, BLOCK] -> [R, KVH, M, D], or its first G rows of each head written into `out`
    [R, KVH, G, D] (returned as [R, KVH * G, D]). Few ops, each on its tensors as they lie: a decode
    layer is short, and an op or a view costs microseconds (these bmm calls are the ones
    `torch.matmul` makes of the same shapes, without its broadcasting and reshapes: 54 -> 32 us a
    layer at one row)."""
    r, kvh, nb, m, d = q.shape
    blk = keys.shape[3]
    # one product per block, each of inner size D (columns do not change a score)
    scores = torch.bmm(q.view(-1, m, d), keys.view(-1, blk, d).transpose(1, 2))
    p = scores.view(r, kvh, nb, m, blk).masked_fill_(hidden, float("-inf"))
    p.sub_(p.amax(dim=(2, 4), keepdim=True)).exp2_()  # a max is exact in any order
    parts = torch.bmm(scores, values.view(-1, blk, d))
    if nb == 1:  # one block: these sums are what the cumsums below give
        return _divide(parts.view(r, kvh, m, d), p.sum(-1).view(r, kvh, m), out)
    # the blocks' sums added in block order: cumsum is one sequential loop (in double)
    return _divide(parts.view(r, kvh, nb, m, d).cumsum(2)[:, :, -1], p.sum(-1).cumsum(2)[:, :, -1], out)


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
