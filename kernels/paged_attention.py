"""Paged attention over a block-table KV cache: Triton kernels and their plain-PyTorch references.

Layout (one layer):
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
  block `s // block_size`, offset `s % block_size`.
- A step's tokens are flattened (varlen): `q` is `[num_tokens, num_heads, head_dim]`; sequence `b` owns rows
  `query_start_loc[b]:query_start_loc[b+1]`, which are its *last* `q_len` positions out of `seq_lens[b]`
  (so cached-prefix tokens, chunked prefill and decode are the same case). Attention is causal.
- `block_tables[b, i]` is the physical block holding the sequence's tokens `i*block_size ... (i+1)*block_size-1`.

Kernels (one entry point, `paged_attention`, picks between two launches of the same kernel):

| batch                          | grid                                      | one program                                  |
|--------------------------------|-------------------------------------------|----------------------------------------------|
| prefill / mixed                | `(num_tokens // BLOCK_Q + num_seqs, Hkv)` | BLOCK_Q query tokens x G heads, all its keys |
| decode (`max_query_len` <= 8)  | `(num_seqs, Hkv, num_splits)`             | a sequence's queries x G heads, 1/num_splits of the keys |

The G = num_heads / num_kv_heads query heads sharing a KV head are packed into the rows of one tile, so each
K/V tile is read once per KV head. Keys are visited tile by tile through the block table with the
flash-attention recurrence, in fp32 and in log2 units (`s = q.k * scale * log2(e)`):

    m' = max(m, max_j s_j),   a = 2^(m - m'),   l' = a l + sum_j 2^(s_j - m'),   acc' = a acc + sum_j 2^(s_j - m') v_j

and `out = acc / l`. Decode splits a sequence's keys over `num_splits` programs (flash-decoding); each writes
its `(m, l, acc)` and a merge kernel computes `out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`,
`M = max_s m_s` (having the last split program merge instead, with a counter per (sequence, KV head), measured
406 against 194 us per Llama-3-8B batch-1 step on an H200 for attention + merge: its loop over the splits' partials
is a chain of L2 round trips; 382eec9, reverted). Grids depend only on `num_tokens`, `num_seqs` and static
settings (the split count comes from the `max_seq_len` bound); per-sequence lengths are read on the device, so
launches can be captured in CUDA graphs.

FP8 KV cache (`kv_cache_dtype='fp8'`): the caches are `float8_e4m3fn` and every (token, KV head) row carries its
own fp32 scale in `k_scale` / `v_scale` `[num_blocks, block_size, num_kv_heads]` (contiguous), so slot `s`,
head `h` has its scale at `s * num_kv_heads + h`. A write quantizes each row with `scale = max|x| / 448`,
`x8 = clamp(x / scale, -448, 448)` (round to nearest even); a read dequantizes `x8 * scale` in fp32. The
attention kernel folds the key scales into the fp32 scores, `s_j = (q . k8_j) * ks_j` (the same sum, one
multiply per score), and dequantizes each V tile in fp32 before `P @ V`, which runs in q's dtype.
"""
import functools
import math
import os

import torch
import triton
import triton.language as tl

from .rotary import _rotary_pairs, _rotate_heads, apply_rotary_ref
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait

__all__ = ['reshape_and_cache', 'reshape_and_cache_ref', 'rotary_and_cache', 'rotary_and_cache_ref', 'paged_attention', 'paged_attention_ref', 'quantize_kv_ref',
           'FP8_MAX', 'FP8_DTYPE', 'MIN_KEYS_PER_SPLIT']

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
SCALE_MIN = 1e-12  # floor of max|x| for a row's scale (an all-zero row must not divide by 0)
_FP8_MAX, _SCALE_MIN = tl.constexpr(FP8_MAX), tl.constexpr(SCALE_MIN)  # the same, readable inside kernels


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------

def quantize_kv_ref(x):
    "FP8 rows with one scale each: `x` `[T, Hkv, D]` -> (`float8_e4m3fn` `[T, Hkv, D]`, fp32 scales `[T, Hkv]`)."
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(SCALE_MIN) / FP8_MAX
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _write_rows(cache, slots, rows):
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == FP8_DTYPE:  # CPU has no fp8 index_copy_: copy the bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows.to(flat.dtype))


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write `key`/`value` `[T, Hkv, D]` into the caches at `slot_mapping` `[T]` (slots < 0 are skipped). FP8
    caches: each row is quantized with its own scale, written to `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, sc in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = x[keep]
        if cache.dtype == FP8_DTYPE:
            x, s = quantize_kv_ref(x)
            sc.view(-1, sc.shape[-1]).index_copy_(0, slots, s)
        _write_rows(cache, slots, x)


def _dense_attention(q, k, v, qpos, kv_len, scale, sliding_window):
    """Masked attention of a padded batch in fp32: `q` `[B, H, M, D]`, `k`/`v` `[B, Hkv, L, D]`,
    `qpos` `[B, M]` absolute query positions, `kv_len` `[B]`. Returns `[B, H, M, D]` fp32."""
    B, H, M, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    kpos = torch.arange(L, device=q.device)
    mask = (kpos <= qpos[..., None]) & (kpos < kv_len[:, None, None])  # [B, M, L]
    if sliding_window is not None: mask &= kpos > qpos[..., None] - sliding_window
    mask |= ~mask.any(-1, keepdim=True)  # padded query rows: attend anywhere, result is dropped
    # GQA without copying K/V: the G heads sharing a KV head become G*M rows of that head
    qg = q.float().reshape(B, Hkv, G * M, D)
    mg = mask[:, None, None].expand(B, 1, G, M, L).reshape(B, 1, G * M, L)
    o = torch.nn.functional.scaled_dot_product_attention(qg, k.float(), v.float(), attn_mask=mg, scale=scale)
    return o.reshape(B, H, M, D)


def _gather_kv(cache, block_tables, n, scale=None):
    "Dense `[B, Hkv, n, D]` view of the first `n` tokens of each sequence (FP8: dequantized to fp32 with `scale`)."
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    idx = block_tables[:, :nblk].long()
    g = cache[idx]  # [B, nblk, bs, Hkv, D]
    if scale is not None: g = g.float() * scale[idx][..., None]
    return g.reshape(g.shape[0], nblk * bs, *cache.shape[2:])[:, :n].transpose(1, 2)


REF_SCORE_BUDGET = 1 << 26  # fp32 scores per query chunk of the reference's prefill path (256 MiB)


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                        sliding_window: int | None = None, max_query_len: int | None = None,
                        max_seq_len: int | None = None, k_scale=None, v_scale=None):
    """Causal attention of varlen queries over paged K/V; returns `[num_tokens, num_heads, head_dim]`.
    Single-token queries (decode) are batched together; longer ones go one sequence at a time, in query
    chunks that keep the score matrix small. Rows past `query_start_loc[-1]` are zero. `max_query_len` and
    `max_seq_len` are accepted for parity with `paged_attention` and not needed here. FP8 caches are read
    through their per-row scales `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`."""
    if k_cache.dtype == FP8_DTYPE: assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
    T, H, D = q.shape
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    B, dev = len(sl), q.device
    out = q.new_zeros(T, H, D)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(B)]
    dec = [b for b in range(B) if q_lens[b] == 1 and sl[b] > 0]
    if dec:
        idx = torch.tensor(dec, device=dev)
        lens = seq_lens[idx].long()
        L = max(sl[b] for b in dec)
        rows = query_start_loc[idx].long()
        k = _gather_kv(k_cache, block_tables[idx], L, k_scale)
        v = _gather_kv(v_cache, block_tables[idx], L, v_scale)
        o = _dense_attention(q[rows][:, :, None], k, v, (lens - 1)[:, None], lens, scale, sliding_window)
        out[rows] = o[:, :, 0].to(q.dtype)
    for b in range(B):
        n = q_lens[b]
        if n <= 1 or sl[b] == 0: continue
        ctx = sl[b] - n
        chunk = max(1, REF_SCORE_BUDGET // (H * sl[b]))
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            L = ctx + e  # keys visible to the chunk's last query
            k = _gather_kv(k_cache, block_tables[b:b + 1], L, k_scale)
            v = _gather_kv(v_cache, block_tables[b:b + 1], L, v_scale)
            qpos = torch.arange(ctx + s, ctx + e, device=dev)[None]
            qc = q[qsl[b] + s:qsl[b] + e].transpose(0, 1)[None]  # [1, H, m, D]
            o = _dense_attention(qc, k, v, qpos, torch.tensor([L], device=dev), scale, sliding_window)
            out[qsl[b] + s:qsl[b] + e] = o[0].transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _round_to_e4m3(x):
    # x fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), still fp32, so that the cast that follows is
    # exact: the interpreter's fp32 -> fp8 cast drops the carry when rounding up to a power of two (127.9 -> 64).
    # e4m3 keeps 3 mantissa bits: ulp = 2^(E - 3) for |x| in [2^E, 2^(E+1)), and 2^-9 below 2^-6 (subnormals)
    e = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased fp32 exponent of x, >= that of 2^-6
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(E - 3)
    inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - E): multiplying by it is exact
    y = x * inv_ulp  # |y| <= 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds y to an integer, ties to even
    return y * ulp


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, slot, h, d, mask, num_kv_heads, FP8: tl.constexpr):
    # x [BLOCK_H, BLOCK_D]; FP8: one scale per head row, max|x| / 448, stored beside the cache
    if FP8:
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), _SCALE_MIN), _FP8_MAX)  # [BLOCK_H]; IEEE division
        tl.store(scale_ptr + slot * num_kv_heads + h, scale[:, None], mask=h < num_kv_heads)
        x = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX), _FP8_MAX))
        tl.store(cache_ptr, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(cache_ptr, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv(k, v, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, h, d, mask,
              stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, num_kv_heads,
              BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    "Write one token's K and V rows `[BLOCK_H, BLOCK_D]` to cache slot `slot` (>= 0)."
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    _store_row(k, k_cache_ptr + blk * stride_kcb + off * stride_kco + h * stride_kch + d, k_scale_ptr, slot, h, d,
               mask, num_kv_heads, FP8)
    _store_row(v, v_cache_ptr + blk * stride_vcb + off * stride_vco + h * stride_vch + d, v_scale_ptr, slot, h, d,
               mask, num_kv_heads, FP8)


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                              num_kv_heads, head_dim,
                              BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                              FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        _store_kv(k, v, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, h, d, mask,
                  stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, num_kv_heads, BLOCK_SIZE, FP8)


def _check_scales(k_cache, k_scale, v_scale):
    "True for an FP8 cache (whose scales must be contiguous fp32 `[num_blocks, block_size, Hkv]`)."
    if k_cache.dtype != FP8_DTYPE: return False
    for sc in (k_scale, v_scale):
        assert sc is not None and sc.dtype == torch.float32 and sc.is_contiguous() and sc.shape == k_cache.shape[:3], \
            "an FP8 cache needs contiguous fp32 scales [num_blocks, block_size, num_kv_heads]"
    return True


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    "Triton `reshape_and_cache_ref`: scatter `key`/`value` `[T, Hkv, D]` to their slots (slots < 0 skipped)."
    T, Hkv, D = key.shape
    if T == 0: return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale if fp8 else key, v_scale if fp8 else value,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv, D, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D), FP8=fp8, num_warps=4 if Hkv * D >= 1024 else 1)


# ---------------------------------------------------------------------------------------------------------------
# rotary_and_cache: the rotary embedding fused with the cache write (one launch per layer instead of two)
# ---------------------------------------------------------------------------------------------------------------

def rotary_and_cache_ref(q, key, value, positions, cos_sin_cache, head_dim, is_neox, k_cache, v_cache, slot_mapping,
                         k_scale=None, v_scale=None):
    "Reference: `apply_rotary_ref` on q and k, then `reshape_and_cache_ref` of the rotated k and v; returns rotated q."
    qr, kr = apply_rotary_ref(q, key, positions, cos_sin_cache, head_dim, is_neox)
    reshape_and_cache_ref(kr.view(key.shape), value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return qr


@triton.jit
def _rotary_and_cache_kernel(q_ptr, key_ptr, value_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                             k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_c, stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                             n_q_heads, num_kv_heads, head_dim,
                             HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr, FP8: tl.constexpr,
                             PDL: tl.constexpr):
    """One token: rotate its q heads in place (pairs, as `_rotary_kernel`), and write its rotated k and its v to
    the cache slot. k is not written back: each k element is rotated from itself and its pair partner in
    registers (`y_d = x_d cos - x_p sin` for the first of a pair, `x_d cos + x_p sin` for the second)."""
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    pdl_launch(PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i1, i2, r_ok, cos, sin = _rotary_pairs(cs_ptr + pos * stride_c, HALF, BLOCK_R, IS_NEOX)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, i1, i2, r_ok, cos, sin, BLOCK_H=BLOCK_HQ)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        rot = d < 2 * HALF
        if IS_NEOX:
            first = d < HALF
            j = tl.where(first, d, d - HALF)             # index into cos / sin
            p = tl.where(first, d + HALF, d - HALF)      # pair partner
        else:
            first = (d % 2) == 0
            j = d // 2
            p = tl.where(first, d + 1, d - 1)
        kb = key_ptr + t * stride_kt + h * stride_kh
        x = tl.load(kb + d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(kb + p, mask=mask & rot, other=0.0).to(tl.float32)
        c = tl.load(cs_ptr + pos * stride_c + j, mask=rot, other=1.0).to(tl.float32)
        sn = tl.load(cs_ptr + pos * stride_c + HALF + j, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(rot, x * c + tl.where(first, -xp, xp) * sn, x)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        _store_kv(y, v, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, h, d, mask,
                  stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, num_kv_heads, BLOCK_SIZE, FP8)


def rotary_and_cache(q, key, value, positions, cos_sin_cache, head_dim, is_neox, k_cache, v_cache, slot_mapping,
                     k_scale=None, v_scale=None):
    """Triton `rotary_and_cache_ref`: `q` `[T, H, D]` rotated in place (returned), the rotated `key` and `value`
    `[T, Hkv, D]` scattered to their slots (slots < 0 skipped; `key` itself is left as it was)."""
    T, H, D = q.shape
    Hkv = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim <= head_dim == D and rot_dim % 2 == 0 and cos_sin_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    if T == 0: return q
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    _rotary_and_cache_kernel[(T,)](
        q, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else key, v_scale if fp8 else value,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H, Hkv, D, HALF=rot_dim // 2, BLOCK_R=triton.next_power_of_2(rot_dim // 2), BLOCK_HQ=triton.next_power_of_2(H),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(D),
        IS_NEOX=is_neox, FP8=fp8, num_warps=4 if H * D >= 2048 else 1, **pdl_kw(q.device))
    return q


# ---------------------------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        qsl_ptr, seq_lens_ptr, block_tables_ptr,
        k_scale_ptr, v_scale_ptr,  # FP8 cache: fp32 scale per (slot, KV head), at slot * num_kv_heads + head
        qk_scale,  # softmax scale * log2(e): scores live in log2 units so that exp() becomes exp2()
        num_seqs, head_dim, num_kv_heads,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
        stride_bt, stride_pt, stride_ph,
        QUERIES_PER_KV: tl.constexpr,  # G = num_heads // num_kv_heads
        G_P: tl.constexpr,  # G rounded up to a power of 2
        BLOCK_Q: tl.constexpr,  # query tokens per tile
        BLOCK_M: tl.constexpr,  # rows per tile, >= BLOCK_Q * G_P (row r = token r // G_P, head r % G_P)
        HEAD_DIM_P: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
        WINDOW: tl.constexpr,  # sliding window (0: off)
        DIRECT: tl.constexpr,  # program 0-axis index == sequence index (every q_len <= BLOCK_Q)
        SPLIT: tl.constexpr,  # write unnormalized partials for _merge_splits_kernel instead of the output
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,  # upcast bf16 dot operands (the Triton interpreter mis-multiplies bf16)
        FP8_KV: tl.constexpr,  # float8_e4m3fn caches with per-row scales; dots run in q's dtype
        PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_launch(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # --- which sequence and which of its query tiles this program owns ---------------------------------------
    if DIRECT:
        seq = tile
        q_tile = 0
    else:
        # Sequence b's tiles start at global tile qsl[b] // BLOCK_Q + b: monotone in b, and leaves room for
        # ceil(q_len / BLOCK_Q) tiles, so the grid num_tokens // BLOCK_Q + num_seqs is enough (a few idle).
        # Binary search for the last sequence whose first tile is <= `tile`.
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
                lo = mid
            else:
                hi = mid
        seq = lo
        q_tile = tile - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start

    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len  # tokens before the first query (cached prefix / earlier chunks)

        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + offs_m // G_P  # query index within the sequence
        g = offs_m % G_P
        row_ok = (offs_m < BLOCK_Q * G_P) & (q_idx < q_len) & (g < QUERIES_PER_KV)
        head = kvh * QUERIES_PER_KV + g
        q_pos = ctx_len + q_idx  # absolute position of the row's query
        token = (q_start + q_idx).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM_P)
        d_ok = offs_d < head_dim
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)

        # --- key range: causal end of the tile's last query, sliding-window start of its first ---------------
        kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
        kv_start = 0
        if WINDOW > 0:
            kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
        kv_start = (kv_start // TILE_N) * TILE_N
        # this program's share, in whole tiles (split == 0 of 1 takes everything)
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), num_splits)
        lo_n = kv_start + split * tiles_per_split * TILE_N
        hi_n = tl.minimum(lo_n + tiles_per_split * TILE_N, kv_end)

        # --- online softmax: m = running row max, l = running sum of exp2(s - m), acc = sum exp2(s - m) v ------
        m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo_n, hi_n, TILE_N):
            offs_n = start + tl.arange(0, TILE_N)
            n_ok = offs_n < hi_n
            # each key's physical block through the block table (a tile may span several pages)
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            page_off = offs_n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + (blk * stride_kb + page_off * stride_ko + kvh * stride_kh)[:, None]
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if FP8_KV:
                k = k.to(q.dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
                scale_idx = (blk * PAGE + page_off) * num_kv_heads + kvh
                k_scale = tl.load(k_scale_ptr + scale_idx, mask=n_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
            if FP8_KV:
                s = s * k_scale[None, :]  # q . (k8 * ks) = (q . k8) * ks
            visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float('-inf'))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)  # fully masked row so far: avoid inf - inf
            alpha = tl.math.exp2(m_i - m_safe)  # rescale of the old sums to the new max
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + (blk * stride_vb + page_off * stride_vo + kvh * stride_vh)[:, None]
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if FP8_KV:  # dequantize the tile in fp32 (folding vs into p could underflow fp16 probabilities)
                v_scale = tl.load(v_scale_ptr + scale_idx, mask=n_ok, other=0.0)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            p = p.to(v.dtype)  # P @ V runs in the cache dtype (FP8: q's dtype), accumulating in fp32
            if DOT_F32:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new

        if SPLIT:
            # partial results of this split; _merge_splits_kernel rescales them to a common max
            ph = token * stride_pt + head * stride_ph + split
            tl.store(part_m_ptr + ph, m_i, mask=row_ok)
            tl.store(part_l_ptr + ph, l_i, mask=row_ok)
            tl.store(part_acc_ptr + ph[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, head_dim,
                         stride_ot, stride_oh, stride_pt, stride_ph,
                         SPLITS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, PDL: tl.constexpr):
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s (empty splits have m_s = -inf)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pdl_wait(PDL)
    pdl_launch(PDL)
    offs_s = tl.arange(0, SPLITS_P)
    s_ok = offs_s < num_splits
    base = t * stride_pt + h * stride_ph + offs_s
    m = tl.load(part_m_ptr + base, mask=s_ok, other=float('-inf'))
    l = tl.load(part_l_ptr + base, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float('-inf'), 0.0, m_max))
    l_tot = tl.sum(w * l, 0)
    offs_d = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM_P + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_KEYS_PER_SPLIT = 256   # a decode step whose `max_seq_len` bound is at most this runs one split (no merge kernel)


def _default_num_splits(q, num_seqs, num_kv_heads, max_seq_len, min_keys_per_split=MIN_KEYS_PER_SPLIT, max_splits=32):
    "Enough KV splits for about four waves of programs (measured best on an H200), each covering >= `min_keys_per_split` keys."
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 8
    want = triton.cdiv(4 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, min_keys_per_split), max_splits))


_INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
DECODE_MAX_QUERY_LEN = 8  # batches whose longest query is at most this many tokens take the split-KV path


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                    sliding_window: int | None = None, max_query_len: int | None = None,
                    max_seq_len: int | None = None, out=None, num_kv_splits: int | None = None,
                    k_scale=None, v_scale=None):
    """Triton `paged_attention_ref` for mixed batches (prefill, chunked prefill, decode), GQA, fp32/fp16/bf16
    queries over a cache of the same dtype or FP8 (with `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`).

    `max_query_len` / `max_seq_len` are upper bounds read on the host (computed from the tensors, with a
    device sync, when None): they pick the decode path and the number of KV splits, so pass static values
    when capturing CUDA graphs. `num_kv_splits` overrides the split count of the decode path."""
    T, H, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    assert H % Hkv == 0, (H, Hkv)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    if out is None: out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0: return out
    if max_query_len is None: max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None: max_seq_len = int(seq_lens.max())

    G = H // Hkv
    G_P = triton.next_power_of_2(G)
    D_P = max(16, triton.next_power_of_2(D))
    fp32 = q.dtype == torch.float32
    dot_f32 = _INTERPRET and q.dtype == torch.bfloat16
    precision = 'ieee' if fp32 or dot_f32 else 'tf32'  # 'tf32' is ignored for 16-bit inputs
    qk_scale = scale * math.log2(math.e)
    decode = max_query_len <= DECODE_MAX_QUERY_LEN
    if decode:
        block_q = triton.next_power_of_2(max(1, max_query_len))
        block_m = max(16, block_q * G_P)
        splits = num_kv_splits or _default_num_splits(q, B, Hkv, max_seq_len)
        grid = (B, Hkv, splits)
        tile_n = 32 if fp32 or D_P > 128 else 64
        warps, stages = 4, (2 if fp32 else 3)
    else:
        block_m = max(16, 64 if fp32 or D_P > 128 else 128, G_P)
        block_q = block_m // G_P
        splits = 1
        grid = (T // block_q + B, Hkv, 1)
        tile_n = 32 if fp32 or D_P > 128 else 64
        warps, stages = (4 if block_m <= 64 else 8), 2
    split = splits > 1
    if split:
        part_m = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(T, H, splits, D_P, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables, k_scale if fp8 else q, v_scale if fp8 else q, qk_scale, B, D, Hkv,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), H * splits, splits,
        QUERIES_PER_KV=G, G_P=G_P, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM_P=D_P, PAGE=page,
        TILE_N=tile_n, WINDOW=sliding_window or 0, DIRECT=decode, SPLIT=split, PRECISION=precision, DOT_F32=dot_f32,
        FP8_KV=fp8, num_warps=warps, num_stages=stages, **pdl_kw(q.device))
    if split:
        _merge_splits_kernel[(T, H)](
            out, part_acc, part_m, part_l, splits, D, out.stride(0), out.stride(1), H * splits, splits,
            SPLITS_P=triton.next_power_of_2(splits), HEAD_DIM_P=D_P, num_warps=4 if D_P >= 128 else 2,
            **pdl_kw(q.device))
    return out
