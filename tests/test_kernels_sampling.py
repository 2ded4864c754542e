"""Sampling kernels (cvllm_lab.kernels.sampling): penalties, top-k/top-p/min-p filtering, seeded draws.

Penalties and the kept set of every filter must match the references exactly; the references are checked
against plain per-row loops. The kernel's random draws are checked statistically (chi-square against the
filtered softmax), for determinism (same seed and offset, same token, whatever the batch) and exactly for
greedy and top_k=1. CPU runs the kernels under TRITON_INTERPRET=1 with few draws; `-m cuda` uses a 128k
vocabulary and many more draws.
"""

import math

import pytest
import torch

from cvllm_lab.kernels import sampling as S

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
I32, I64 = torch.int32, torch.int64


def params(rows, device=DEV):
    "Per-row tensors from `(temperature, top_k, top_p, min_p)` tuples."
    t, k, p, m = zip(*rows)
    return (
        torch.tensor(t, device=device),
        torch.tensor(k, dtype=I32, device=device),
        torch.tensor(p, device=device),
        torch.tensor(m, device=device),
    )


def kernel_mask(logits, temp, top_k, top_p, min_p):
    "Kept set of the kernel: scaled logits at or above its per-row threshold."
    thr = S.sampling_thresholds(logits, temp, top_k, top_p, min_p)
    l, _ = S._scaled(logits, temp)
    return l >= thr[:, None]


def chi2_critical(dof, z=3.7):
    "Upper critical value of chi-square at about p = 1e-4 (Wilson-Hilferty)."
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_draws_match(tokens, probs):
    "Draws only from the support, with frequencies consistent with `probs` (chi-square, p ~ 1e-4)."
    n = tokens.numel()
    assert probs[tokens].min() > 0, 'drew a filtered-out token'
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    exp = probs[support].double() * n
    chi2 = ((counts[support] - exp) ** 2 / exp).sum().item()
    assert chi2 < chi2_critical(int(support.sum()) - 1), (chi2, counts[support].tolist(), exp.tolist())


# ------------------------------------------------------------------------------------------------ penalties


def penalties_loop(logits, prompt_mask, counts, rep, freq, pres):
    "The penalty rule token by token."
    out = logits.clone()
    for b in range(out.shape[0]):
        for j in range(out.shape[1]):
            x, c = out[b, j].item(), int(counts[b, j])
            if prompt_mask[b, j] or c > 0:
                x = x / rep[b].item() if x > 0 else x * rep[b].item()
            out[b, j] = x - freq[b].item() * c - pres[b].item() * (c > 0)
    return out


def random_penalty_inputs(B, V, device=DEV):
    logits = torch.randn(B, V, device=device) * 3
    prompt_mask = torch.rand(B, V, device=device) < 0.2
    counts = torch.where(torch.rand(B, V, device=device) < 0.3, torch.randint(1, 4, (B, V), device=device), 0).to(I32)
    rep = torch.rand(B, device=device) + 0.8
    freq = torch.rand(B, device=device) * 0.5
    pres = torch.rand(B, device=device) * 0.5
    return logits, prompt_mask, counts, rep, freq, pres


def test_apply_penalties():
    torch.manual_seed(0)
    logits, *rest = random_penalty_inputs(4, 300)
    ref = S.apply_penalties_ref(logits.clone(), *rest)
    torch.testing.assert_close(ref.cpu(), penalties_loop(logits.cpu(), *[t.cpu() for t in rest]))
    out = logits.clone()
    assert S.apply_penalties(out, *rest) is out
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    neutral = S.apply_penalties(
        logits.clone(),
        rest[0],
        rest[1],
        torch.ones(4, device=DEV),
        torch.zeros(4, device=DEV),
        torch.zeros(4, device=DEV),
    )
    assert torch.equal(neutral, logits)


# ------------------------------------------------------------------------------------------------ filters


def mask_loop(logits, t, k, p, min_p):
    "One row's kept set, straight from the definitions (sort, cumulative mass)."
    V = logits.numel()
    if t < S.GREEDY_EPS:
        return logits == logits.max()
    l = logits.double() / t
    keep = torch.ones(V, dtype=torch.bool)
    if 0 < k < V:
        keep &= l >= l.sort(descending=True).values[k - 1]
    if p < 1:
        w = torch.where(keep, torch.exp(l - l.max()), 0.0)
        keep &= torch.tensor([w[l > l[j]].sum() < max(p, 1e-9) * w.sum() for j in range(V)])
    if min_p > 0:
        probs = torch.softmax(torch.where(keep, l, -torch.inf), 0)
        keep &= probs >= min_p * probs.max()
    return keep


ROWS = [
    (1.0, 0, 1.0, 0.0),  # nothing filtered
    (0.0, 0, 1.0, 0.0),  # greedy
    (0.7, 5, 1.0, 0.0),  # top-k
    (1.0, 1, 1.0, 0.0),  # top-1
    (1.3, 0, 0.9, 0.0),  # top-p
    (0.5, 0, 0.3, 0.0),
    (1.0, 0, 1.0, 0.05),  # min-p
    (0.9, 40, 0.8, 0.02),  # all three
    (2.0, 10, 0.5, 0.0),
    (1.0, 3, 0.0, 0.0),  # top-p 0: the top token
    (1.0, 1000, 1.0, 0.0),
]  # k >= V: off


def test_reference_mask_matches_loop():
    torch.manual_seed(1)
    logits = torch.randn(len(ROWS), 200) * 2
    ref = S.sampling_mask_ref(logits, *params(ROWS, 'cpu'))
    for b, row in enumerate(ROWS):
        assert torch.equal(ref[b], mask_loop(logits[b], *row)), (b, row)


def test_kernel_mask_matches_reference():
    torch.manual_seed(2)
    logits = torch.randn(len(ROWS), 1000, device=DEV) * 2
    args = params(ROWS)
    assert torch.equal(kernel_mask(logits, *args), S.sampling_mask_ref(logits, *args))


def test_kernel_mask_with_ties():
    "Ties at the top-k boundary are kept together; so are tokens of equal probability at the top-p boundary."
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 2.0]] * 3, device=DEV)
    args = params([(1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.0)])
    got = kernel_mask(logits, *args)
    assert torch.equal(got, S.sampling_mask_ref(logits, *args))
    assert got[0].tolist() == [True, False, True, True, True, False, False, True]  # the 2nd largest is a 4-way tie


# ------------------------------------------------------------------------------------------------ draws


def test_greedy_and_top1_exact():
    torch.manual_seed(3)
    B, V = 8, 500
    logits = torch.randn(B, V, device=DEV)
    rows = [(0.0, 0, 1.0, 0.0)] * 4 + [(1.0, 1, 0.9, 0.1), (5.0, 1, 1.0, 0.0), (1e-6, 50, 0.5, 0.0), (0.5, 1, 1.0, 0.0)]
    tok = S.sample(logits, *params(rows), torch.arange(B, device=DEV), torch.full((B,), 11, device=DEV))
    assert tok.dtype == I64 and torch.equal(tok, logits.argmax(-1))
    ref = S.sample_ref(logits, *params(rows))
    assert torch.equal(ref, logits.argmax(-1))


def test_draw_depends_only_on_seed_and_offset():
    torch.manual_seed(4)
    V = 64
    logits = torch.randn(6, V, device=DEV)
    args = params([(1.0, 0, 1.0, 0.0), (0.8, 20, 0.9, 0.0)] * 3)
    seeds = torch.tensor([7, 7, 123, 123, 2**40 + 5, 99], device=DEV)
    offsets = torch.tensor([0, 5, 3, 3, 2**35 + 1, 1], device=DEV)
    tok = S.sample(logits, *args, seeds, offsets)
    perm = torch.tensor([3, 5, 0, 4, 1, 2], device=DEV)
    tok_perm = S.sample(logits[perm], *[a[perm] for a in args], seeds[perm], offsets[perm])
    assert torch.equal(tok_perm, tok[perm])
    for b in (0, 4):  # alone in a batch of one
        assert (
            S.sample(logits[b : b + 1], *[a[b : b + 1] for a in args], seeds[b : b + 1], offsets[b : b + 1]) == tok[b]
        )
    # new offsets give new draws: the same row over 30 offsets is not constant
    n = 30
    draws = S.sample(
        logits[:1].expand(n, V).contiguous(),
        *[a[:1].expand(n) for a in args],
        seeds[:1].expand(n),
        torch.arange(n, device=DEV),
    )
    assert draws.unique().numel() > 5


N_DRAWS = 100_000 if DEV == 'cuda' else 500  # the interpreter runs ~15 ms per plain row, ~80 ms filtered


def test_draw_frequencies_temperature():
    "Frequencies of the kernel's draws against softmax(logits / T) (one row, fresh offsets)."
    torch.manual_seed(5)
    logits = torch.tensor([0.5, -1.0, 1.5, 0.0, 1.0, -0.5], device=DEV)
    T, n = 1.4, N_DRAWS
    tok = S.sample(
        logits.expand(n, -1).contiguous(),
        *params([(T, 0, 1.0, 0.0)] * n),
        torch.full((n,), 42, device=DEV),
        torch.arange(n, device=DEV),
    )
    assert_draws_match(tok, torch.softmax(logits / T, -1))


def test_draw_frequencies_filtered():
    "Draws under top-k + top-p + min-p come from the kept set, with the renormalized probabilities."
    torch.manual_seed(6)
    logits = torch.tensor([2.0, 1.6, -1.0, 1.2, 0.3, 0.0, 0.9, -3.0], device=DEV)
    row = (0.8, 5, 0.9, 0.05)
    n = N_DRAWS // 3
    keep = S.sampling_mask_ref(logits[None], *params([row]))[0]
    assert 2 < keep.sum() < 5  # the filters do bite
    probs = torch.softmax(torch.where(keep, logits / row[0], -torch.inf), -1)
    tok = S.sample(
        logits.expand(n, -1).contiguous(),
        *params([row] * n),
        torch.full((n,), 3, device=DEV),
        torch.arange(n, device=DEV) + 1000,
    )
    assert_draws_match(tok, probs)
    # the reference sampler's own draws follow the same law
    g = torch.Generator(device=DEV).manual_seed(0)
    ref = S.sample_ref(logits.expand(n, -1).contiguous(), *params([row] * n), generator=g)
    assert_draws_match(ref, probs)


def test_compute_logprobs():
    torch.manual_seed(7)
    logits = torch.randn(3, 50, device=DEV)
    vals, ids, tok = S.compute_logprobs(logits, 4, torch.tensor([1, 2, 3], device=DEV))
    lp = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(vals.double(), lp.topk(4).values)
    assert torch.equal(ids, lp.topk(4).indices)
    torch.testing.assert_close(tok.double(), lp[torch.arange(3), torch.tensor([1, 2, 3])])


# ------------------------------------------------------------------------------------------------ CUDA, real sizes


@pytest.mark.cuda
def test_cuda_real_vocab():
    "Batch 64 over a 128k vocabulary: penalties and kept sets against the references, greedy exact."
    torch.manual_seed(8)
    B, V = 64, 128256
    logits, *rest = random_penalty_inputs(B, V)
    ref = S.apply_penalties_ref(logits.clone(), *rest)
    torch.testing.assert_close(S.apply_penalties(logits.clone(), *rest), ref, rtol=1e-6, atol=1e-5)
    rows = [ROWS[i % len(ROWS)] for i in range(B)]
    rows = [(t, k if k != 1000 else V, p, m) for t, k, p, m in rows]
    args = params(rows)
    got, want = kernel_mask(ref, *args), S.sampling_mask_ref(ref, *args)
    # the top-p boundary compares fp32 sums taken in different orders: allow a rare one-token disagreement
    bad = (got != want).sum(-1)
    assert bad.max() <= 1 and (bad > 0).sum() <= 2, bad.nonzero().flatten().tolist()
    tok = S.sample(ref, *args, torch.arange(B, device=DEV), torch.zeros(B, dtype=I64, device=DEV))
    assert got[torch.arange(B), tok].all()
    greedy = args[0] < S.GREEDY_EPS
    assert torch.equal(tok[greedy], ref.argmax(-1)[greedy])


def test_argmax_one_launch():
    "`argmax`: chunks merged by atomic max of (value, -index) keys: torch's first maximum, -0.0 == +0.0, any dtype."
    V = 128256 if DEV == 'cuda' else 9000
    for B in (1, 3, 31):
        x = torch.randn(B, V, device=DEV)
        x[0, 11] = x[0, V - 5] = x.max() + 1  # a tie across chunks: the first
        for t in (x, x.bfloat16(), x.half()):
            assert torch.equal(S.argmax(t), t.argmax(-1))
        assert torch.equal(S.argmax(x, block=1024), x.argmax(-1))  # more chunks; the workspace resets itself
    x = torch.full((2, V), -3.0, device=DEV)
    x[0, 6000] = -0.0
    x[0, V - 1] = 0.0
    x[1, 2] = 1.0
    assert S.argmax(x).tolist() == [6000, 2]
