"""Token sampling on the GPU with no host sync: penalties, temperature, top-k, top-p, min-p, seeded draws.

Semantics (the references below define them; the kernels match them exactly, draws aside, up to the order of
fp32 sums at the top-p boundary):

- `apply_penalties`: for tokens seen in the prompt or the output, a logit `x > 0` becomes `x / rep`, else
  `x * rep`; then `x -= frequency * count_out + presence * (count_out > 0)`.
- `sample`: rows with `temperature < 1e-5` are greedy (argmax of the raw logits, first index on ties).
  Otherwise `l = logits / temperature`, and a token is kept when it passes every active filter:
  top-k (`0 < k < V`): `l >= ` the k-th largest `l` (ties at the boundary are kept);
  top-p (`p < 1`): the probability mass of kept-by-top-k tokens with a strictly larger `l` is `< p`
  (the smallest set of mass >= p, always the top token, ties kept together; `p <= 0` keeps the top token);
  min-p (`min_p > 0`): `prob >= min_p * max prob`, i.e. `l >= max l + log(min_p)`.
  The kept set is `l >= threshold` for one per-row threshold, and the draw is Gumbel-max over it:
  `argmax_j l_j - log(E_j)`, `E_j = -log(U_j)` exponential, `U_j` from Philox keyed by the row's seed with
  counter `(j, offset)`. A draw depends only on `(logits row, seed, offset)`, never on the batch.

Kernel design: one program per row loops over the vocabulary in blocks. The thresholds are found without
sorting: bisection over the 32-bit order-preserving integer key of the float logits, each step one pass over
the row (counting keys for top-k, summing `exp(l - max)` for top-p) that also finds the hull of the keys
left strictly inside the interval; the next pivot splits that hull, and the search stops as soon as the
boundary is pinned between two adjacent attained values (at most ~33 passes, usually far fewer; rows without
top-k/top-p do none).
"""

import torch
import triton
import triton.language as tl

__all__ = [
    'apply_penalties',
    'apply_penalties_ref',
    'sample',
    'sample_ref',
    'sampling_thresholds',
    'sampling_mask_ref',
    'compute_logprobs',
    'argmax',
    'GREEDY_EPS',
]

GREEDY_EPS = 1e-5
KEY_BIG: tl.constexpr = tl.constexpr(1 << 40)  # beyond every key
KEY_NEG_INF: tl.constexpr = tl.constexpr(-2139095041)  # _key(-inf): bits 0xFF800000 with the magnitude flipped


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------


def apply_penalties_ref(logits, prompt_mask, output_counts, repetition, frequency, presence):
    "Repetition / frequency / presence penalties, in place on `logits` `[B, V]` fp32; returns `logits`."
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
    logits -= frequency[:, None] * output_counts.float()
    logits -= presence[:, None] * (output_counts > 0).float()
    return logits


def _scaled(logits, temperature):
    "`logits / temperature` (temperature 1 for greedy rows) and the greedy row mask."
    greedy = temperature < GREEDY_EPS
    return logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None], greedy


def sampling_mask_ref(logits, temperature, top_k, top_p, min_p):
    "Bool `[B, V]` of the tokens `sample` may draw (greedy rows: the argmax ties)."
    l, greedy = _scaled(logits, temperature)
    B, V = l.shape
    m = l.max(-1, keepdim=True).values
    keep = torch.ones_like(l, dtype=torch.bool)
    # top-k: at least the k-th largest value
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    kth = l.sort(-1, descending=True).values.gather(-1, (k.clamp(1, V) - 1)[:, None])
    keep &= ~k_on[:, None] | (l >= kth)
    # top-p over the top-k survivors: mass of strictly larger logits < p * total
    w = torch.where(keep, torch.exp(l - m), 0.0)
    ws, order = torch.sort(torch.where(keep, l, -torch.inf), -1, descending=True)
    wsorted = w.gather(-1, order)
    csum = wsorted.cumsum(-1)
    n_gt = V - torch.searchsorted(ws.flip(-1).contiguous(), l.contiguous(), right=True)  # count of larger l
    above = torch.where(n_gt > 0, csum.gather(-1, (n_gt - 1).clamp_min(0)), 0.0)
    p_on = top_p < 1.0
    keep &= ~p_on[:, None] | (above < top_p[:, None].clamp_min(1e-9) * csum[:, -1:])
    # min-p: prob >= min_p * max prob
    mp_on = min_p > 0
    probs = torch.softmax(torch.where(keep, l, -torch.inf), -1)
    keep &= ~mp_on[:, None] | (probs >= min_p[:, None] * probs.max(-1, keepdim=True).values)
    return torch.where(greedy[:, None], l == m, keep)


def sample_ref(logits, temperature, top_k, top_p, min_p, generator=None):
    "Reference sampler: `sampling_mask_ref` then an exponential race with torch's RNG; int64 `[B]`."
    keep = sampling_mask_ref(logits, temperature, top_k, top_p, min_p)
    l, greedy = _scaled(logits, temperature)
    probs = torch.softmax(torch.where(keep, l, -torch.inf), -1)
    e = torch.empty_like(probs).exponential_(generator=generator)
    drawn = (probs / e).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), drawn)


def compute_logprobs(logits, k: int, token_ids=None):
    """`log_softmax` of `logits` `[B, V]` in fp32: returns `(topk_logprobs [B, k], topk_ids [B, k],
    token_logprobs [B] or None)`, the last for the given `token_ids`."""
    lp = torch.log_softmax(logits.float(), -1)
    vals, ids = lp.topk(k, -1)
    tok = None if token_ids is None else lp.gather(-1, token_ids.long()[:, None])[:, 0]
    return vals, ids, tok


# ---------------------------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _penalties_kernel(
    logits_ptr,
    prompt_ptr,
    counts_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    V,
    stride_l,
    stride_p,
    stride_c,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    rep = tl.load(rep_ptr + row)
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)
    l = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=0.0)
    in_prompt = tl.load(prompt_ptr + row * stride_p + offs, mask=mask, other=0) != 0
    cnt = tl.load(counts_ptr + row * stride_c + offs, mask=mask, other=0)
    in_output = cnt > 0
    penalized = tl.where(l > 0, tl.div_rn(l, rep), l * rep)
    l = tl.where(in_prompt | in_output, penalized, l)
    l = l - freq * cnt.to(tl.float32)
    l = l - pres * in_output.to(tl.float32)
    tl.store(logits_ptr + row * stride_l + offs, l, mask=mask)


def apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence):
    "Triton `apply_penalties_ref`, in place on `logits` `[B, V]` fp32; returns `logits`."
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    assert prompt_mask.stride(-1) == 1 and output_counts.stride(-1) == 1
    if B == 0:
        return logits
    block = min(4096, triton.next_power_of_2(V))
    _penalties_kernel[(B, triton.cdiv(V, block))](
        logits,
        prompt_mask.view(torch.uint8),
        output_counts,
        repetition,
        frequency,
        presence,
        V,
        logits.stride(0),
        prompt_mask.stride(0),
        output_counts.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return logits


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _key(x):
    "Order-preserving map float32 -> int32 (as int64): negative floats get their magnitude bits flipped."
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(k):
    "Inverse of `_key`."
    b = k.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _load_scaled(row_ptr, offs, V, temp):
    return tl.div_rn(tl.load(row_ptr + offs, mask=offs < V, other=float('-inf')).to(tl.float32), temp)


@triton.jit
def _row_max(row_ptr, V, temp, BLOCK: tl.constexpr):
    m = float('-inf')
    for start in range(0, V, BLOCK):
        m = tl.maximum(m, tl.max(_load_scaled(row_ptr, start + tl.arange(0, BLOCK), V, temp), 0))
    return m


@triton.jit
def _scan(row_ptr, V, temp, m, lo, mid, hi, floor_key, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the row: `stat` = count of keys >= mid (top-k) or sum of exp(l - m) over keys > mid and
    >= floor_key (top-p); plus the min/max attained key strictly inside (lo, mid) and inside (mid, hi)."""
    stat = 0.0
    l_min = tl.full([], KEY_BIG, tl.int64)
    l_max = tl.full([], -KEY_BIG, tl.int64)
    r_min = tl.full([], KEY_BIG, tl.int64)
    r_max = tl.full([], -KEY_BIG, tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        l = _load_scaled(row_ptr, offs, V, temp)
        key = _key(l)
        ok = offs < V
        if MASS:
            stat += tl.sum(tl.where(ok & (key > mid) & (key >= floor_key), tl.exp(l - m), 0.0), 0)
        else:
            stat += tl.sum((ok & (key >= mid)).to(tl.float32), 0)
        left = ok & (key > lo) & (key < mid)
        right = ok & (key > mid) & (key < hi)
        l_min = tl.minimum(l_min, tl.min(tl.where(left, key, KEY_BIG), 0))
        l_max = tl.maximum(l_max, tl.max(tl.where(left, key, -KEY_BIG), 0))
        r_min = tl.minimum(r_min, tl.min(tl.where(right, key, KEY_BIG), 0))
        r_max = tl.maximum(r_max, tl.max(tl.where(right, key, -KEY_BIG), 0))
    return stat, l_min, l_max, r_min, r_max


@triton.jit
def _bisect(row_ptr, V, temp, m, lo, hi, target, floor_key, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Shrink (lo, hi) around the boundary of the monotone predicate `stat(x) < target` (false at lo, true
    at hi) until no attained key lies strictly between them; returns (lo, hi). Each pass splits the hull
    [a, b] of the attained keys still inside at its middle, so the hull at least halves per pass."""
    a = lo + 1
    b = hi - 1
    go = a <= b
    while go:
        mid = a + (b - a + 1) // 2
        stat, l_min, l_max, r_min, r_max = _scan(row_ptr, V, temp, m, lo, mid, hi, floor_key, MASS, BLOCK)
        if stat < target:
            hi = mid
            a = l_min
            b = l_max
        else:
            lo = mid
            a = r_min
            b = r_max
        go = a <= b
    return lo, hi


@triton.jit
def _threshold_key(row_ptr, V, temp, m, top_k, top_p, min_p, BLOCK: tl.constexpr):
    "Key of the smallest kept scaled logit of a sampled row (key(-inf) when nothing is filtered)."
    key_min = tl.full([], KEY_NEG_INF - 1, tl.int64)  # below every key
    thr = key_min
    # top-k: lo ends on the k-th largest key (count(key >= lo) >= k > count(key >= hi))
    if (top_k > 0) & (top_k < V):
        lo, hi = _bisect(
            row_ptr, V, temp, m, key_min, _key(m) + 1, top_k.to(tl.float32), key_min, MASS=False, BLOCK=BLOCK
        )
        thr = lo
    # top-p over the top-k survivors: hi ends on the smallest key whose strictly-larger mass is < p * Z
    if top_p < 1.0:
        z, _, _, _, _ = _scan(row_ptr, V, temp, m, key_min, thr - 1, key_min, thr, MASS=True, BLOCK=BLOCK)
        _, hi = _bisect(row_ptr, V, temp, m, thr - 1, _key(m), tl.maximum(top_p, 1e-9) * z, thr, MASS=True, BLOCK=BLOCK)
        thr = hi
    # min-p: l >= max + log(min_p)
    if min_p > 0.0:
        thr = tl.maximum(thr, _key(m + tl.log(min_p)))
    return thr


@triton.jit
def _argmax_raw(row_ptr, V, BLOCK: tl.constexpr):
    best = float('-inf')
    best_idx = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        l = tl.load(row_ptr + offs, mask=offs < V, other=float('-inf')).to(tl.float32)
        bm = tl.max(l, 0)
        bi = tl.argmax(l, 0) + start
        best_idx = tl.where(bm > best, bi, best_idx)
        best = tl.maximum(best, bm)
    return best_idx


@triton.jit
def _sample_kernel(
    logits_ptr,
    out_ptr,
    thr_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    offset_ptr,
    V,
    stride_l,
    GREEDY_EPS: tl.constexpr,
    THRESHOLDS_ONLY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp < GREEDY_EPS:
        if THRESHOLDS_ONLY:
            tl.store(thr_ptr + row, _row_max(row_ptr, V, temp * 0.0 + 1.0, BLOCK))
        else:
            tl.store(out_ptr + row, _argmax_raw(row_ptr, V, BLOCK).to(tl.int64))
    else:
        m = _row_max(row_ptr, V, temp, BLOCK)
        thr = _threshold_key(
            row_ptr,
            V,
            temp,
            m,
            tl.load(top_k_ptr + row),
            tl.load(top_p_ptr + row).to(tl.float32),
            tl.load(min_p_ptr + row).to(tl.float32),
            BLOCK,
        )
        if THRESHOLDS_ONLY:
            tl.store(thr_ptr + row, _unkey(tl.maximum(thr, KEY_NEG_INF)))
        else:
            # Gumbel-max over the kept tokens: argmax l_j - log(E_j), E_j = -log(U_j) ~ Exp(1)
            seed = tl.load(seed_ptr + row)
            offset = tl.load(offset_ptr + row).to(tl.int64)
            best = float('-inf')
            best_idx = 0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                l = _load_scaled(row_ptr, offs, V, temp)
                c0 = offs.to(tl.uint32)
                c1 = (c0 * 0) + (offset & 0xFFFFFFFF).to(tl.uint32)
                c2 = (c0 * 0) + (offset >> 32).to(tl.uint32)
                r, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
                u = tl.uint_to_uniform_float(r)
                score = tl.where((offs < V) & (_key(l) >= thr), l - tl.log(-tl.log(u)), float('-inf'))
                bm = tl.max(score, 0)
                bi = tl.argmax(score, 0) + start
                best_idx = tl.where(bm > best, bi, best_idx)
                best = tl.maximum(best, bm)
            tl.store(out_ptr + row, best_idx.to(tl.int64))


def _launch_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, thresholds_only):
    B, V = logits.shape
    assert logits.stride(-1) == 1
    res = torch.empty(B, dtype=torch.float32 if thresholds_only else torch.int64, device=logits.device)
    if B == 0:
        return res
    block = min(2048, triton.next_power_of_2(V))
    # the kernel indexes per-row tensors by row: make them dense (an `expand`ed view has stride 0; no copy otherwise)
    temperature, top_k, top_p, min_p = (t.contiguous() for t in (temperature, top_k, top_p, min_p))
    seeds, offsets = (None if t is None else t.contiguous() for t in (seeds, offsets))
    dummy = res if seeds is None else seeds
    _sample_kernel[(B,)](
        logits,
        res,
        res,
        temperature,
        top_k,
        top_p,
        min_p,
        dummy,
        dummy if offsets is None else offsets,
        V,
        logits.stride(0),
        GREEDY_EPS=GREEDY_EPS,
        THRESHOLDS_ONLY=thresholds_only,
        BLOCK=block,
        num_warps=8,
    )
    return res


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """Triton sampler: token ids int64 `[B]` (see the module docstring). `logits` `[B, V]` fp32 (any float
    dtype works), per-row `temperature`, `top_k` int32, `top_p`, `min_p`, `seeds` int64, `offsets` int64."""
    return _launch_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, False)


def sampling_thresholds(logits, temperature, top_k, top_p, min_p):
    """Per-row smallest kept value of `logits / temperature` (raw logits for greedy rows): the kept set of
    `sample` is `logits / temperature >= threshold`. fp32 `[B]`, -inf when nothing is filtered."""
    return _launch_sample(logits, temperature, top_k, top_p, min_p, None, None, True)


# ---------------------------------------------------------------------------------------------------------------
# Greedy argmax of few long rows, in one launch
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, best_ptr, cnt_ptr, V, stride_l, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's first maximum as one int64 `_key(value) << 32 | (2**32 - 1 - index)`,
    merged by `atomic_max` into the row's slot (larger value first, then smaller index); the row's last program
    (counted on `cnt_ptr`) decodes the index and leaves slot and counter as it found them (`INT64_MIN`, 0)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < V, other=float('-inf')).to(tl.float32) + 0.0
    m = tl.max(x, 0)  # + 0.0 above: -0.0 becomes +0.0 (torch's argmax treats them as equal)
    i = tl.min(tl.where(x == m, offs, V), 0).to(tl.int64)
    key = (_key(m) << 32) | (0xFFFFFFFF - i)
    tl.atomic_max(best_ptr + row, key, sem='relaxed')
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + row, 1, sem='acq_rel') == tl.num_programs(1) - 1:
        best = tl.atomic_xchg(best_ptr + row, -9223372036854775808, sem='relaxed')
        tl.store(out_ptr + row, 0xFFFFFFFF - (best & 0xFFFFFFFF))
        tl.store(cnt_ptr + row, 0)


_ARGMAX_WS = {}


def argmax(logits, block: int = 4096):
    """`logits.argmax(-1)` (int64, first index of the maximum) for `[B, V]` logits of any float dtype: `cdiv(V,
    block)` programs per row and one launch (a per-device workspace of B slots, self-resetting). For the decode
    step's few long rows, where PyTorch's reduction runs as two launches of few programs each."""
    B, V = logits.shape
    assert logits.stride(-1) == 1 and V < 2**31
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    ws = _ARGMAX_WS.get(logits.device)
    if ws is None or ws[0].numel() < B:
        n = max(B, 64)
        ws = _ARGMAX_WS[logits.device] = (
            torch.full((n,), -(2**63), dtype=torch.int64, device=logits.device),
            torch.zeros(n, dtype=torch.int32, device=logits.device),
        )
    _argmax_kernel[(B, triton.cdiv(V, block))](logits, out, ws[0], ws[1], V, logits.stride(0), BLOCK=block, num_warps=8)
    return out
