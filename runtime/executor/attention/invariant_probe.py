"""The start-up probe of the batch-invariant attention backend (`invariant_backend.py`): the bits it
relies on are properties of the BLAS, not promises, so they are checked on this CPU before the
backend runs, for the model's head shape and each candidate least row count."""

from __future__ import annotations

import functools

import torch

from radixlm.runtime.executor.attention import decode_kv
from radixlm.runtime.executor.attention.invariant_decode import per_block


@functools.cache
def probe(num_kv_heads: int, group: int, head_dim: int, min_rows: int) -> bool:
    """Whether `_decode` and `_extend` give a query the same bits alone (a decode of one), among 300
    positions of one request (a prefill), in a padded batch of requests (a decode) and in chunks behind shared
    blocks (`_decode_shared`, `_extend_shared`) on this CPU, for this head shape; the shapes cover
    the kernels MKL picks between (few or many rows, one or many blocks)."""
    from radixlm.runtime.executor.attention import invariant_backend as ib  # late: it imports this module

    gen = torch.Generator().manual_seed(0)
    kvh, g, d, n = num_kv_heads, group, head_dim, 300

    class Pool:
        k = [torch.randn(2048, kvh, d, generator=gen)]
        v = [torch.randn(2048, kvh, d, generator=gen)]

    table = torch.randperm(2048, generator=gen)[None, :1024]
    q = torch.randn(1, kvh, n, g, d, generator=gen)  # [1, KVH, positions, G, D]
    pos = torch.arange(700, 700 + n)

    def gather(rows: int, width: int):
        slots = decode_kv.slots(table, torch.zeros(rows, dtype=torch.int64), width)
        return decode_kv.gather(Pool, 0, decode_kv.pool_rows(slots, kvh), rows, kvh, width)

    def decode(q: torch.Tensor, width: int, lens: torch.Tensor):  # q [R, KVH, G, D]
        keys, values = gather(q.shape[0], width)
        padded = q.new_zeros(q.shape[0], kvh, max(g, min_rows), d)
        padded[:, :, :g] = q
        hidden = decode_kv.blocked(torch.arange(width)[None, :] >= lens[:, None])[:, None, :, None]
        return ib._decode(per_block(padded, width // ib.BLOCK), keys, values, hidden, g)

    keys, values = gather(1, 1024)
    hidden = torch.arange(1024)[None, :] > pos.repeat_interleave(g)[:, None]
    whole = ib._extend(q.view(kvh, n * g, d), keys[0], values[0], 0, hidden, min_rows).view(kvh, n, g, d)
    picked = [0, 1, 63, 64, 299]
    batch = decode(q[0, :, picked].transpose(0, 1), decode_kv.padded(int(pos[picked[-1]]) + 1), pos[picked] + 1)
    # the same rows with their first 10 blocks (all below position 700) as shared blocks
    start, width = 10 * ib.BLOCK, decode_kv.padded(int(pos[picked[-1]]) + 1)
    sk, sv = gather(1, start)
    keys, values = gather(len(picked), width)
    padded = q.new_zeros(len(picked), kvh, max(g, min_rows), d)
    padded[:, :, :g] = q[0, :, picked].transpose(0, 1)
    hidden_own = decode_kv.blocked(torch.arange(width)[None, :] >= (pos[picked] + 1)[:, None])[:, None, 10:, None]
    shared = ib._decode_shared(per_block(padded, width // ib.BLOCK - 10), sk[0], sv[0], keys[:, :, 10:],
                               values[:, :, 10:], hidden_own)[:, :, :g]
    # chunks of one, two and one positions behind the same 10 shared blocks, in one cascade extend
    ranges = [(0, 2), (63, 65), (299, 300)]
    own, diags, hiddens, qs = [], [], [], []
    for lo, hi in ranges:
        width = decode_kv.padded(int(pos[hi - 1]) + 1)
        k, v = gather(1, width)
        own.append((k[0, :, 10:], v[0, :, 10:]))
        diags.append(int(pos[lo]) - start)
        hiddens.append(torch.arange(int(pos[lo]), width)[None, :] > pos[lo:hi].repeat_interleave(g)[:, None])
        qs.append(q[0, :, lo:hi].reshape(kvh, (hi - lo) * g, d))
    cascade = ib._extend_shared(qs, sk[0], sv[0], own, diags, hiddens, min_rows)
    for (lo, hi), out in zip(ranges, cascade):
        if not torch.equal(out.view(kvh, hi - lo, g, d), whole[:, lo:hi]):
            return False
    for j, i in enumerate(picked):
        alone = decode(q[:, :, i], decode_kv.padded(int(pos[i]) + 1), pos[i : i + 1] + 1)
        one = ib._extend(q[0, :, i], *(x[0] for x in gather(1, 1024)), 0, hidden[i * g : i * g + g], min_rows)
        if not all(torch.equal(x, whole[:, i]) for x in (alone[0], batch[j], shared[j], one)):
            return False
    return True
