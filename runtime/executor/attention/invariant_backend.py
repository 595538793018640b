"""Batch-invariant attention on the CPU: a query's output is bitwise the same in any batch.

The torch backend's answers depend on the batch in the last bits: a decode pads every request's
keys to the batch's longest, a cached or chunked prefill takes another SDPA path than a whole one,
and MKL's sgemm picks kernels by shape (one query row goes through a GEMV, a long key axis is cut
into blocks whose partial sums are added in another order). float32 absorbs that; int8 activations
(`--quantization int8`) round it into a different token now and then. Here every reduction has a
fixed order that depends only on the query's own position and keys:

- keys are read from position 0 in blocks of `BLOCK`, aligned to absolute positions, so a prefill,
  a chunk, a cached extension and a decode see the same blocks; a block past a query's position is
  masked whole and adds exact zeros;
- scores are products over the head dimension (never cut into blocks) with at least `min_rows`
  query rows (zero rows make up a decode's few), the shapes in which each output element is the
  same dot product whatever the other rows and columns are (MKL takes other paths for one or two
  rows, and for up to 4 or 8 rows at head dims of 96 and more);
- the value product runs block by block (inner size `BLOCK`), and the blocks' partial sums, like
  the softmax denominators, are added in block order in double precision: by `cumsum` in a decode
  (one sequential loop with a double accumulator on the CPU), by `_block_order_sum` in an extend
  (the same adds, one block at a time).

Whole blocks every request of a step holds in the same slots (a system prompt, few-shot examples,
a fork, n > 1) are gathered once and scored for all the step's rows in one product, in a decode
(`_decode_shared`) and in an extend (`_extend_shared`); the sums still run in each row's block order.
Consecutive decodes keep what they gathered, the shared blocks and each row's own keys (decode_kv.py).

The weights are `exp2` of scores taken in base 2 (the query scale holds log2(e)): the same softmax,
and on AMD EPYC CPUs torch's `exp` runs about 3x slower than its `exp2`, enough to be a tenth of a
long prefill.

The second and third are properties of the BLAS, not promises, so `probe()` (invariant_probe.py)
runs every path on one set of queries at start-up, picks the fewest rows that pass, and the backend
refuses to run where none does. Costs against the torch backend: keys padded to a whole block, each
chunk's upper triangle scored and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.executor.attention import decode_kv
from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.attention.invariant_decode import Frame
from radixlm.runtime.executor.attention.invariant_decode import decode as _decode  # noqa: F401 (the probe's)
from radixlm.runtime.executor.attention.invariant_decode import decode_into as _decode_into
from radixlm.runtime.executor.attention.invariant_decode import decode_shared as _decode_shared
from radixlm.runtime.executor.attention.invariant_probe import probe
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

BLOCK = decode_kv.BLOCK  # keys per value-product block
ROW_CHOICES = (4, 8, 16, 32)  # query rows per score matmul at least: the first that `probe` finds invariant
CHUNK_ELEMS = 1 << 22  # score elements per extend chunk at most (bounds memory on long prompts)
LOG2E = 1.4426950408889634  # folded into the query scale: softmax weights are 2**(s - max), see the docstring
SPLIT_ROWS = 64  # query rows from which an extend's score product is split in halves (see _scores)
CHUNK_TOKENS = 128  # query tokens per extend chunk at most: each chunk scores its whole diagonal block


@dataclass(slots=True)
class _Keys:
    """A decode step's plan, shared by its layers: `index()` picks rows of the pool seen as
    [slots * KVH, D] in the order [R, KVH, W] (one gather, no transposed copy); `frame` holds the
    buffers this run of decodes reuses (invariant_decode.Frame: the mask, the per-block queries, the
    scratch), rewritten for this step."""

    index: decode_kv.LazyIndex
    frame: Frame
    rows: int
    shared: torch.Tensor | None  # index of the whole blocks every row shares (gathered once), or None
    shared_width: int
    new_rows: torch.Tensor  # [R * KVH]: where each row's new token goes in the kept keys (decode_kv.row_starts)


@dataclass(slots=True)
class _Chunk:
    """Up to CHUNK_TOKENS new tokens of one extend row, planned once per step for every layer."""

    width: int  # its request's keys up to the chunk's last query, padded to a block
    lo: int  # rows of the step's flat queries
    hi: int
    diag: int  # the first query's position: keys before it are visible to the whole chunk
    request: int  # which request of the step (its row in the batch)
    hidden: torch.Tensor  # [n * G, width - diag]: keys from diag on that each query row must not see


@dataclass(slots=True)
class _ExtendPlan:
    """An extend step's chunks, and each request's own keys (`own`: their index, see _Keys.index, and
    width, from `start` to its last chunk's width): a request's chunks read ever longer prefixes of
    them, so a layer gathers them once and each chunk takes its prefix (gathering per chunk would read
    a long prefill's keys many times over). With `shared` (the index of `start` leading keys every request of the
    step holds in the same slots, all before its first new token), the shared keys are gathered once
    and scored once per wave of chunks (`waves`: lists of chunk numbers whose scores, shared and own,
    hold at most CHUNK_ELEMS elements together, or one chunk)."""

    chunks: list[_Chunk]
    own: list[tuple[torch.Tensor, int]]
    shared: torch.Tensor | None
    start: int
    waves: list[list[int]]


class InvariantAttentionBackend(AttentionBackend):
    name = "invariant"
    supports_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        group = num_heads // num_kv_heads
        min_rows = next((r for r in ROW_CHOICES if probe(num_kv_heads, group, head_dim, r)), None)
        if min_rows is None:
            raise RuntimeError("batch-invariant attention is not available on this CPU: its BLAS gives one "
                               "row of a matmul different values in different shapes (see invariant_backend.py)")
        self.min_rows = min_rows
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = group
        self.head_dim = head_dim
        self.scale = (scale if scale is not None else head_dim**-0.5) * LOG2E
        # what consecutive decodes keep of their gathers (decode_kv.py); any extend drops both
        self._shared_kv: decode_kv.SharedKV | None = None
        self._own_kv: decode_kv.OwnKV | None = None
        self._frame: Frame | None = None  # the plan's buffers for the kept rows (invariant_decode.Frame)
        self._step = 0  # decode steps planned: a layer's kept keys are used only by the step after its last

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.req_to_token.device.type != "cpu":
            raise RuntimeError("the invariant attention backend runs on the CPU only")
        if batch.mode is not ForwardMode.DECODE:
            self._shared_kv = self._own_kv = self._frame = None  # an extend may write slots later decodes read
            batch.attn_metadata = self._extend_plan(batch)
            return
        width = decode_kv.padded(max(batch.seq_lens_host))
        b, kvh = batch.batch_size, self.num_kv_heads
        # the blocks every row holds in the same slots (a few-shot prefix, fork, n > 1): read once
        start = batch.shared_prefix_len // BLOCK * BLOCK if b > 1 else 0
        shared = decode_kv.pool_rows(batch.req_to_token[batch.req_rows[:1], :start], kvh) if start else None
        kept, own = self._shared_kv, self._own_kv
        if shared is None:
            self._shared_kv = None
        elif kept is None or not kept.matches(batch.kv_pool, shared):
            self._shared_kv = decode_kv.SharedKV(batch.kv_pool, shared, {})
        if own is None or not own.matches(batch.kv_pool, batch.req_rows, start, width - start):
            own = self._own_kv = decode_kv.OwnKV(batch.kv_pool, batch.req_rows.clone(), start, width - start, {})
        self._step += 1
        frame = self._frame
        if frame is None or frame.own is not own:
            frame = self._frame = Frame.new(own, b, kvh, self.group, self.min_rows, self.head_dim)
        torch.ge(frame.cols, batch.seq_lens[:, None], out=frame.hidden)  # keys past each row's length
        new_rows = torch.add(frame.heads, (batch.seq_lens - 1 - start)[:, None]).view(-1)
        index = decode_kv.LazyIndex(batch.req_to_token, batch.req_rows, width, start, kvh)
        batch.attn_metadata = _Keys(index, frame, b, shared, start, new_rows)

    def forward_decode(self, q, k, v, layer, batch):
        meta: _Keys = batch.attn_metadata
        b, kvh, g, d = meta.rows, self.num_kv_heads, self.group, self.head_dim
        own = self._own_kv.get(batch.kv_pool, layer, self._step, meta.index, kvh, meta.new_rows,
                               k.view(b, kvh, d), v.view(b, kvh, d))
        frame = meta.frame
        torch.mul(q.view(b, kvh, 1, g, d).expand(frame.scaled.shape), self.scale, out=frame.scaled)  # once per block
        out = q.new_empty(b, self.num_heads, d)
        if frame.scratch is not None:
            _decode_into(frame.scratch, own.keys_t, own.value_blocks, out.view(b, kvh, g, d))
            return out
        width = meta.shared_width
        sk, sv = self._shared_kv.get(layer, lambda pool, i, index: decode_kv.gather(pool, i, index, 1, kvh, width))
        return _decode_shared(frame.queries, sk[0], sv[0], own.keys, own.values, frame.blocked, out.view(b, kvh, g, d))

    def forward_extend(self, q, k, v, layer, batch):
        plan: _ExtendPlan = batch.attn_metadata
        kvh, g, d, start = self.num_kv_heads, self.group, self.head_dim, plan.start
        out = torch.empty_like(q)

        def queries(c: _Chunk) -> torch.Tensor:  # [KVH, n * G, D], scaled
            n = c.hi - c.lo
            return (q[c.lo : c.hi].float() * self.scale).view(n, kvh, g, d).transpose(0, 1).reshape(kvh, n * g, d)

        def put(c: _Chunk, o: torch.Tensor) -> None:
            n = c.hi - c.lo
            out[c.lo : c.hi] = o.view(kvh, n, g, d).transpose(0, 1).reshape(n, kvh * g, d).to(q.dtype)

        held: tuple[int, torch.Tensor, torch.Tensor] | None = None  # one request's own K/V (chunks come in order)

        def own(c: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:  # [KVH, nb, BLOCK, D] from `start` to c.width
            nonlocal held
            if held is None or held[0] != c.request:
                index, width = plan.own[c.request]
                keys, values = decode_kv.gather(batch.kv_pool, layer, index, 1, kvh, width)
                held = (c.request, keys[0], values[0])
            nb = (c.width - start) // BLOCK
            return held[1][:, :nb], held[2][:, :nb]

        if plan.shared is None:
            for c in plan.chunks:
                put(c, _extend(queries(c), *own(c), c.diag, c.hidden, self.min_rows))
            return out
        sk, sv = decode_kv.gather(batch.kv_pool, layer, plan.shared, 1, kvh, start)
        for wave in plan.waves:
            chunks = [plan.chunks[i] for i in wave]
            outs = _extend_shared([queries(c) for c in chunks], sk[0], sv[0], [own(c) for c in chunks],
                                  [c.diag - start for c in chunks], [c.hidden for c in chunks], self.min_rows)
            for c, o in zip(chunks, outs):
                put(c, o)
        return out

    def _extend_plan(self, batch: ForwardBatch) -> _ExtendPlan:
        kvh, g = self.num_kv_heads, self.group
        # whole blocks every request holds in the same slots (a system prompt, few-shot examples, n > 1),
        # all before every new token: gathered and scored once for the step's rows, not once per request
        shared = batch.shared_prefix_len // BLOCK * BLOCK if len(batch.req_rows) > 1 else 0
        chunks, own, first = [], [], 0
        for i, (n_new, n_all) in enumerate(zip(batch.extend_lens_host, batch.seq_lens_host)):
            prefix = n_all - n_new
            step = min(CHUNK_TOKENS, max(1, CHUNK_ELEMS // (kvh * g * decode_kv.padded(n_all))))
            for lo in range(0, n_new, step):
                hi = min(n_new, lo + step)
                width = decode_kv.padded(prefix + hi)
                q_pos = torch.arange(prefix + lo, prefix + hi).repeat_interleave(g)  # one per query row
                diag = prefix + lo  # every key before the chunk's first query is visible to all of it
                chunks.append(_Chunk(width, first + lo, first + hi, diag, i,
                                     torch.arange(diag, width)[None, :] > q_pos[:, None]))
            width = decode_kv.padded(n_all)  # the last chunk's
            slots = decode_kv.slots(batch.req_to_token, batch.req_rows[i : i + 1], width)[:, shared:]
            own.append((decode_kv.pool_rows(slots, kvh), width - shared))
            first += n_new
        if not shared:
            return _ExtendPlan(chunks, own, None, 0, [])
        waves: list[list[int]] = [[]]
        held = 0  # score elements of the wave so far: a wave holds every chunk's scores at once
        for i, c in enumerate(chunks):
            n = max((c.hi - c.lo) * g, self.min_rows) * kvh * c.width
            if waves[-1] and held + n > CHUNK_ELEMS:
                waves.append([])
                held = 0
            waves[-1].append(i)
            held += n
        head = decode_kv.pool_rows(batch.req_to_token[batch.req_rows[:1], :shared], kvh)
        return _ExtendPlan(chunks, own, head, shared, waves)


def _extend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, diag: int, hidden: torch.Tensor,
            min_rows: int) -> torch.Tensor:
    """Queries of one request, any positions: `_decode`'s arithmetic in the same order (one value
    product per block, the blocks' sums added in block order), with the scores of all blocks in one
    product (a score's inner size is D either way). q [KVH, M, D] (scaled), keys/values
    [KVH, nb, BLOCK, D], hidden [M, W - diag]: which keys from position `diag` on each query must not
    see (all before it are visible) -> [KVH, M, D]."""
    kvh, m, _ = q.shape
    nb = keys.shape[1]
    scores = _masked_scores(_pad_rows(q, min_rows), keys, diag, hidden)
    p = scores.sub_(scores.amax(-1, keepdim=True)).exp2_().view(kvh, -1, nb, BLOCK).transpose(1, 2)
    if nb == 1:
        return (torch.matmul(p, values)[:, 0] / p.sum(-1)[:, 0, :, None])[:, :m]
    den = p.sum(-1).cumsum(1)[:, -1]  # [KVH, M]
    return (_block_order_sum(_value_products(p, values)) / den[..., None])[:, :m]


def _pad_rows(q: torch.Tensor, min_rows: int) -> torch.Tensor:
    """q [KVH, M, D] with zero rows making up `min_rows` (their outputs are dropped)."""
    kvh, m, d = q.shape
    return q if m >= min_rows else torch.cat([q, q.new_zeros(kvh, min_rows - m, d)], dim=1)


def _masked_scores(q: torch.Tensor, keys: torch.Tensor, diag: int, hidden: torch.Tensor) -> torch.Tensor:
    """q [KVH, R, D] (`_pad_rows`) against keys [KVH, nb, BLOCK, D] in one product -> [KVH, R, nb * BLOCK],
    with the keys that `hidden` [M <= R, W - diag] marks from `diag` on set to -inf (padding rows
    repeat the first row's mask)."""
    kvh, rows, d = q.shape
    if hidden.shape[0] < rows:
        hidden = torch.cat([hidden, hidden[:1].expand(rows - hidden.shape[0], -1)])
    scores = _scores(q, keys.view(kvh, -1, d))
    scores[:, :, diag:].masked_fill_(hidden, float("-inf"))
    return scores


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [KVH, R, D] times keys [KVH, W, D] transposed -> [KVH, R, W]. MKL runs a batched product one
    matrix per thread, so 3 KV heads on 2 threads take the time of 2 heads on one thread, where this
    split keeps both threads busy. Each head's rows then go as two halves of one batch, each at
    least SPLIT_ROWS / 2 rows (so past any `min_rows`): a row's scores are the same bits in any number of
    rows from `min_rows` on, which the probe checks on this path."""
    kvh, rows, d = q.shape
    if kvh % torch.get_num_threads() == 0 or rows < SPLIT_ROWS or rows % 2:  # one thread divides every count
        return torch.matmul(q, keys.transpose(-1, -2))
    out = q.new_empty(kvh, rows, keys.shape[1])
    halves, out_halves = q.view(kvh * 2, rows // 2, d), out.view(kvh * 2, rows // 2, -1)
    for h in range(kvh):
        torch.bmm(halves[2 * h : 2 * h + 2], keys[h].t().expand(2, d, -1), out=out_halves[2 * h : 2 * h + 2])
    return out


def _value_products(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """p [KVH, nb, M, BLOCK] (strided blocks of the scores) times values [KVH, nb, BLOCK, D] per block
    -> [KVH, nb, M, D], one product per head: matmul over all heads at once would first copy p into
    block-major order (a third of a long prefill's attention); the products are the same."""
    kvh, nb, m, _ = p.shape
    if nb == 1:  # a product of one block: per head it would be a batch of one, see _batched
        return _batched(p[:, 0], values[:, 0]).unsqueeze(1)
    parts = p.new_empty(kvh, nb, m, values.shape[-1])
    for h in range(kvh):
        torch.bmm(p[h], values[h], out=parts[h])
    return parts


def _batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bmm of a [n, M, K] and b [n, K, N], never as a batch of one: MKL computes a lone matrix product
    with kernels chosen by its row count (rows 1-3, 5-7 and 9-11 of a 64-column product differ from
    the same rows among 64 on an AMD EPYC), where a batch of two or more gives every row the same bits
    from 4 rows on (`probe` picks at least 4). A lone product gets a zero matrix beside it."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    return torch.bmm(torch.cat([a, torch.zeros_like(a)]), torch.cat([b, torch.zeros_like(b)]))[:1]


def _block_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """[KVH, nb, ...] -> [KVH, ...]: `parts.cumsum(1)[:, -1]` to the bit (float32 parts added one
    block after another into a double, rounded once), without the cumsum's other prefixes and
    strided single-element loop: one vectorized add per block, 5x faster on a long prefill."""
    return _block_order_total(parts).float()


def _block_order_total(parts: torch.Tensor) -> torch.Tensor:
    """`_block_order_sum` before its rounding: the double total, for more blocks to be added to."""
    return _block_order_add(parts[:, 0].double(), parts[:, 1:])


def _block_order_add(total: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """Adds the blocks of `parts` [KVH, nb, ...] to the double `total` [KVH, ...] in block order, in place."""
    for b in range(parts.shape[1]):
        total.add_(parts[:, b])
    return total


def _extend_shared(qs: list[torch.Tensor], shared_k: torch.Tensor, shared_v: torch.Tensor,
                   own: list[tuple[torch.Tensor, torch.Tensor]], diags: list[int], hiddens: list[torch.Tensor],
                   min_rows: int) -> list[torch.Tensor]:
    """`_extend` of several chunks whose keys begin with the same blocks ([KVH, s, BLOCK, D], visible
    to every query), in `_extend`'s arithmetic and order: the shared blocks are scored, summed and
    multiplied by their values once for all the chunks' rows, each chunk's own blocks (`own`: keys
    and values [KVH, nb, BLOCK, D] from block s on; `diags` and `hiddens` counted from there) on
    their own; then each row's blocks are added in block order, the shared ones first, as
    `_block_order_sum` and `cumsum` would add them all."""
    kvh, s, _, d = shared_k.shape
    padded = [_pad_rows(q, min_rows) for q in qs]
    scores = [_masked_scores(q, keys, diag, hidden) for q, (keys, _), diag, hidden in zip(padded, own, diags, hiddens)]
    ss = _scores(torch.cat(padded, dim=1), shared_k.view(kvh, s * BLOCK, d))
    bounds = [0]
    for q in padded:
        bounds.append(bounds[-1] + q.shape[1])
    shared_top = ss.amax(-1, keepdim=True)
    tops = [torch.maximum(shared_top[:, lo:hi], so.amax(-1, keepdim=True))  # a max is exact in any order
            for lo, hi, so in zip(bounds, bounds[1:], scores)]
    ps = ss.sub_(torch.cat(tops, dim=1)).exp2_().view(kvh, -1, s, BLOCK).transpose(1, 2)  # [KVH, s, R, BLOCK]
    shared_den = ps.sum(-1)  # [KVH, s, R]
    shared_total = _block_order_total(_value_products(ps, shared_v))
    outs = []
    for lo, hi, so, top, (_, values), q in zip(bounds, bounds[1:], scores, tops, own, qs):
        p = so.sub_(top).exp2_().view(kvh, -1, values.shape[1], BLOCK).transpose(1, 2)
        den = torch.cat([shared_den[:, :, lo:hi], p.sum(-1)], dim=1).cumsum(1)[:, -1]
        total = _block_order_add(shared_total[:, lo:hi].clone(), _value_products(p, values))
        outs.append((total.float() / den[..., None])[:, : q.shape[1]])
    return outs
