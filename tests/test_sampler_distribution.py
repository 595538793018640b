"""Sampler, what sampled rows may draw: the top-k, top-p and min-p filters, grammar masks, and the
empirical distribution of the draws."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from sampler_batches import make_batch, pack

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.sampling import kernels as sampler
from radixlm.runtime.sampling import penalties
from radixlm.runtime.sampling.kernels import SamplingBatch, sample


def draw_many(logits_row, params, n, mask_row=None, seed=0):
    """n independent draws for one row, as one batch of n identical rows."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    mask = None if mask_row is None else mask_row.unsqueeze(0).expand(n, -1).contiguous()
    batch = make_batch([params] * n, logits=logits, seed=seed)
    return sample(logits, batch, mask).next_token_ids


def log_probs(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


# --------------------------------------------------------------------------------------- filters


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(4))
    allowed = set(logits.topk(5).indices.tolist())
    drawn = set(draw_many(logits, SamplingParams(temperature=2.0, top_k=5), 3000).tolist())
    assert drawn == allowed


def test_top_p_keeps_the_nucleus():
    logits = log_probs([0.05, 0.5, 0.15, 0.3])
    ids = draw_many(logits, SamplingParams(top_p=0.75), 4000)
    assert set(ids.tolist()) == {1, 3}
    share = (ids == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    logits = log_probs([0.1, 0.2, 0.3, 0.4])
    # top_k=2 -> {3: 4/7, 2: 3/7}; top_p=0.5 of that is token 3 alone (without renormalizing, 2 as well).
    ids = draw_many(logits, SamplingParams(top_k=2, top_p=0.5), 500)
    assert set(ids.tolist()) == {3}


def test_min_p_drops_unlikely_tokens():
    logits = log_probs([0.5, 0.3, 0.15, 0.05])  # min_p 0.2 -> keep p >= 0.1
    ids = draw_many(logits, SamplingParams(min_p=0.2), 3000)
    assert set(ids.tolist()) == {0, 1, 2}


def reference_threshold(probs, top_k, top_p):
    values = probs.sort(descending=True).values
    kept = values[:top_k] if top_k > 0 else values
    cums = kept.cumsum(0)
    last = int((cums < top_p * (cums[-1] if top_k > 0 else 1.0)).sum())
    t_p = kept[min(last, len(kept) - 1)].item() if top_p < 1 else 0.0
    return max(kept[-1].item() if top_k > 0 else 0.0, t_p)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_filter_thresholds_match_a_full_sort(scale):
    vocab = 3000
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, vocab, generator=gen) * scale
    logits[0, :50] = logits[0, 50]  # ties across the boundary
    settings_ = [(-1, 0.9), (40, 1.0), (40, 0.6), (2000, 0.95), (-1, 0.3), (3, 0.99)]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings_]
    batch = make_batch(params, logits=logits)
    probs = torch.softmax(logits, dim=-1)
    got = sampler._sorted_threshold(probs, batch)
    for row, (k, p) in enumerate(settings_):
        assert got[row].item() == pytest.approx(reference_threshold(probs[row], k, p), rel=1e-6)


# ----------------------------------------------------------------------------------------- masks


def test_mask_is_respected_by_every_method():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, generator=gen) * 2
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[3, 17, 40, 41]] = True
    logits[[5, 6, 7]] += 20.0  # the favourites are all forbidden
    allowed = {3, 17, 40, 41}
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.1),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=5.0),
        SamplingParams(frequency_penalty=-2.0, presence_penalty=-2.0),  # pushes token 5 further up
        SamplingParams(temperature=0, repetition_penalty=0.1),
    ):
        n = 1 if params.greedy else 500
        logits_n = logits.unsqueeze(0).expand(n, -1).contiguous()
        batch = make_batch([params] * n, outputs=[[5, 5, 9]] * n, logits=logits_n)
        ids = sample(logits_n, batch, mask.unsqueeze(0).expand(n, -1)).next_token_ids
        assert set(ids.tolist()) <= allowed, params
    greedy = draw_many(logits, SamplingParams(temperature=0), 1, mask)
    assert greedy.item() == max(allowed, key=lambda t: logits[t].item())


@settings(max_examples=examples(40), deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
)
def test_random_batches_stay_inside_mask_and_top_k(data, rows, vocab):
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * data.draw(st.sampled_from([0.1, 1.0, 10.0]))
    mask = torch.rand(rows, vocab, generator=gen) < 0.5
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            top_k=data.draw(st.sampled_from([-1, 1, 2, 5])),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.3])),
            min_p=data.draw(st.sampled_from([0.0, 0.1, 0.9])),
            frequency_penalty=data.draw(st.sampled_from([0.0, -2.0, 1.0])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.5])),
            sampling_seed=data.draw(st.sampled_from([None, 3])),
        )
        for _ in range(rows)
    ]
    outputs = [torch.randint(vocab, (3,), generator=gen).tolist() for _ in range(rows)]
    batch = make_batch(params, outputs=outputs, logits=logits, seed=seed)
    out = sample(logits, batch, mask)
    for row, token in enumerate(out.next_token_ids.tolist()):
        assert mask[row, token]
        k = params[row].top_k
        if k > 0:
            # at most k-1 allowed tokens may beat it once penalties are in (ties share a rank)
            penalized = logits.clone()
            penalties.apply_penalties_(penalized, batch)
            penalized = penalized[row]
            better = ((penalized > penalized[token]) & mask[row]).sum().item()
            assert better < k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_allowed_tokens_all_at_minus_inf_give_the_lowest_allowed_id(device):
    """A grammar never sees a token it refused: where every allowed logit is -inf (a -inf bias, an
    overflowed forward) greedy and sampled rows alike take their lowest allowed id."""
    vocab = 4096
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2), device="cpu").to(device)
    mask = torch.zeros(4, vocab, dtype=torch.bool, device=device)
    for row, ids in enumerate(([3], [70, 2000], [5, 6, 9], list(range(40, vocab)))):
        mask[row, ids] = True
        logits[row, ids] = float("-inf")
    params = [SamplingParams(temperature=t) for t in (0.0, 0.0, 1.0, 0.0)]
    greedy = [SamplingParams(temperature=0.0)] * 4
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in (params, greedy):
        batch = SamplingBatch.build(rows, [[]] * 4, [[]] * 4, vocab, torch.device(device), generator=gen)
        forms = (mask, pack(mask.cpu()).to(device)) if device == "cpu" else (mask,)
        for form in forms:
            assert sample(logits, batch, form).next_token_ids.tolist() == [3, 70, 5, 40]


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), vocab=st.integers(2, 300))
def test_cpu_mask_path_chooses_what_where_chooses(data, rows, vocab):
    """The CPU applies a mask as a minimum against +-inf in a reused buffer (a packed one to greedy
    rows only where their best token is not allowed): every row's choice is the one
    torch.where(mask, logits, -inf) gives, with inf and NaN logits too, and always an allowed one (a
    NaN behind the mask, or allowed tokens all at -inf, never make a refused choice), over several
    calls that reuse the buffer at different shapes."""
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    specials = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, vocab - 1),
                                            st.sampled_from([float("inf"), float("-inf"), float("nan"), 50.0])),
                                  max_size=6))
    for r, t, value in specials:
        logits[r, t] = value
    mask = torch.rand(rows, vocab, generator=gen) < data.draw(st.sampled_from([0.01, 0.5, 0.99]))
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])), sampling_seed=7)
              for _ in range(rows)]
    batch = make_batch(params, logits=logits, seed=seed)
    want = sample(torch.where(mask, logits, float("-inf")), batch, None).next_token_ids
    # a row with no allowed logit above -inf takes its lowest allowed id, never a refused one
    inside = mask.gather(1, want.unsqueeze(1)).squeeze(1)
    want = torch.where(inside, want, mask.to(torch.uint8).argmax(dim=-1))
    for form in (mask, pack(mask)):  # as a bool mask, and packed as the grammars fill it
        got = sample(logits, batch, form).next_token_ids
        assert torch.equal(got, want) or any(v != v for _, _, v in specials)  # NaN draws may differ
        assert bool(mask.gather(1, got.unsqueeze(1)).all())


# ---------------------------------------------------------------------------------- distribution


def chi_square(ids, probs):
    n = len(ids)
    counts = torch.bincount(ids, minlength=len(probs)).double()
    expected = probs.double() * n
    return ((counts - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.3])
    probs = torch.softmax(logits / temperature, dim=-1)
    ids = draw_many(logits, SamplingParams(temperature=temperature), 4000, seed=11)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi_square(ids, probs) < 24.3


def test_seeded_rows_are_distributed_like_softmax():
    logits = torch.tensor([0.5, -0.3, 1.1, 0.0, -1.0, 0.8])
    probs = torch.softmax(logits, dim=-1)
    n = 3000
    params = [SamplingParams(sampling_seed=s) for s in range(n)]
    batch = make_batch(params, logits=logits.expand(n, -1))
    ids = sample(logits.expand(n, -1).contiguous(), batch).next_token_ids
    assert chi_square(ids, probs) < 20.5  # 5 dof, p = 0.001
