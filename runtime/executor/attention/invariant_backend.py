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

The second and third are properties of the BLAS, not promises, so `probe()` (below)
runs every path on one set of queries at start-up, picks the fewest rows that pass, and the backend
refuses to run where none does. Costs against the torch backend: keys padded to a whole block, each
chunk's upper triangle scored and dropped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixlm.runtime.executor.attention import decode_kv
from radixlm.runtime.executor.attention.base import AttentionBackend
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
    buffers this run of decodes reuses (Frame: the mask, the per-block queries, the
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
        self._frame: Frame | None = None  # the plan's buffers for the kept rows (Frame)
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


# ------------------------------------------------------------------------------------------ decode
# The decode arithmetic: one query position per row, against its keys in blocks of BLOCK, alone
# (`_decode`) or behind blocks every row of the step shares (`_decode_shared`). It is the extend's
# arithmetic in the extend's order; these functions only lay it out for a decode's few query rows, with
# as few ops and views as a short layer allows. A step's buffers and views are made once per step
# (`Scratch`) and kept across the decodes of the same rows (`Frame`).


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


def _decode_into(s: Scratch, keys_t: torch.Tensor, value_blocks: torch.Tensor, out: torch.Tensor) -> None:
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


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
           group: int | None = None) -> torch.Tensor:
    """`decode_into` with its scratch made here (the start-up probe, tests): q [R, KVH, nb, M, D]
    (scaled, `per_block`), keys/values [R, KVH, nb, BLOCK, D] (contiguous), hidden [R, 1, nb, 1, BLOCK]
    -> [R, KVH, G, D], G = `group` (default M)."""
    r, kvh, nb, m, d = q.shape
    g = m if group is None else group
    out = q.new_empty(r, kvh, g, d)
    blk = keys.shape[3]
    _decode_into(Scratch(q, hidden, g), keys.view(-1, blk, d).transpose(1, 2), values.view(-1, blk, d), out)
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


def _decode_shared(q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, keys: torch.Tensor,
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


# ------------------------------------------------------------------------------------------ the probe
# The bits the backend relies on are properties of the BLAS, not promises: checked on this CPU before
# the backend runs, for the model's head shape and each candidate least row count.


@functools.cache
def probe(num_kv_heads: int, group: int, head_dim: int, min_rows: int) -> bool:
    """Whether `_decode` and `_extend` give a query the same bits alone (a decode of one), among 300
    positions of one request (a prefill), in a padded batch of requests (a decode) and in chunks behind shared
    blocks (`_decode_shared`, `_extend_shared`) on this CPU, for this head shape; the shapes cover
    the kernels MKL picks between (few or many rows, one or many blocks)."""
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
        return _decode(per_block(padded, width // BLOCK), keys, values, hidden, g)

    keys, values = gather(1, 1024)
    hidden = torch.arange(1024)[None, :] > pos.repeat_interleave(g)[:, None]
    whole = _extend(q.view(kvh, n * g, d), keys[0], values[0], 0, hidden, min_rows).view(kvh, n, g, d)
    picked = [0, 1, 63, 64, 299]
    batch = decode(q[0, :, picked].transpose(0, 1), decode_kv.padded(int(pos[picked[-1]]) + 1), pos[picked] + 1)
    # the same rows with their first 10 blocks (all below position 700) as shared blocks
    start, width = 10 * BLOCK, decode_kv.padded(int(pos[picked[-1]]) + 1)
    sk, sv = gather(1, start)
    keys, values = gather(len(picked), width)
    padded = q.new_zeros(len(picked), kvh, max(g, min_rows), d)
    padded[:, :, :g] = q[0, :, picked].transpose(0, 1)
    hidden_own = decode_kv.blocked(torch.arange(width)[None, :] >= (pos[picked] + 1)[:, None])[:, None, 10:, None]
    shared = _decode_shared(per_block(padded, width // BLOCK - 10), sk[0], sv[0], keys[:, :, 10:],
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
    cascade = _extend_shared(qs, sk[0], sv[0], own, diags, hiddens, min_rows)
    for (lo, hi), out in zip(ranges, cascade):
        if not torch.equal(out.view(kvh, hi - lo, g, d), whole[:, lo:hi]):
            return False
    for j, i in enumerate(picked):
        alone = decode(q[:, :, i], decode_kv.padded(int(pos[i]) + 1), pos[i : i + 1] + 1)
        one = _extend(q[0, :, i], *(x[0] for x in gather(1, 1024)), 0, hidden[i * g : i * g + g], min_rows)
        if not all(torch.equal(x, whole[:, i]) for x in (alone[0], batch[j], shared[j], one)):
            return False
    return True
