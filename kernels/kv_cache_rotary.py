"""`rotary_and_cache`: the rotary embedding of q and k fused with the paged KV cache write (one launch per layer
instead of two), and its PyTorch reference `rotary_and_cache_ref`.

The cache layout, the FP8 row scales and the row writes (`store_kv`, `check_fp8_scales`) are `kv_cache`'s; the pairs
of the rotation are `rotary`'s. Data flow, one program per token: q heads rotated (in place, or into `q_out`);
k rotated in registers (`_rotated_rows`), v read, both optionally scaled by a deferred RMSNorm's 1/rms, then written
to the token's slot by `kv_cache.store_kv` (and the rotated k to `k_out` if given).
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.kv_cache import check_fp8_scales, reshape_and_cache_ref, store_kv
from cvllm_lab.kernels.kv_cache_int4 import KV4_DTYPE, reshape_and_cache_int4
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.rotary import rotary_pairs, rotate_heads, apply_rotary_ref

__all__ = ['rotary_and_cache', 'rotary_and_cache_ref']


# ---------------------------------------------------------------------------------------------------------------
# rotary_and_cache: the rotary embedding fused with the cache write (one launch per layer instead of two)
# ---------------------------------------------------------------------------------------------------------------


def rotary_and_cache_ref(
    q,
    key,
    value,
    positions,
    cos_sin_cache,
    head_dim,
    is_neox,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
    k_out=None,
    q_out=None,
    rms=None,
):
    """Reference: `apply_rotary_ref` on q and k, then `reshape_and_cache_ref` of the rotated k and v; returns rotated q
    (also written to `q_out` if given; and writes the rotated k to `k_out` `[T, Hkv, D]` if given). `rms=(ssq, n, eps)`:
    q, k and v are first scaled by each token's `rsqrt(ssq / n + eps)` (an RMSNorm's 1/rms, applied late)."""
    if rms is not None:
        s = torch.rsqrt(rms[0].float() / rms[1] + rms[2])[:, None, None]
        q, key, value = q * s, key * s, value * s
    qr, kr = apply_rotary_ref(q, key, positions, cos_sin_cache, head_dim, is_neox)
    reshape_and_cache_ref(kr.view(key.shape), value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k_out is not None:
        k_out.copy_(kr.view(key.shape))
    return qr if q_out is None else q_out.copy_(qr.view(q_out.shape))


@triton.jit
def _rotated_rows(base, stride_h, n_heads, h, d, p, first, rot, c, sn, head_dim):
    """Rows `h` `[BLOCK_H, 1]` (heads at `base + h * stride_h`) rotated, in fp32, and their mask: each element from
    itself and its pair partner `p` (`y_d = x_d cos - x_p sin` for the first of a pair, `x_d cos + x_p sin` for the
    second; dims past the rotary part as they are)."""
    mask = (h < n_heads) & (d < head_dim)
    x = tl.load(base + h * stride_h + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + h * stride_h + p, mask=mask & rot, other=0.0).to(tl.float32)
    return tl.where(rot, x * c + tl.where(first, -xp, xp) * sn, x), mask


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr,
    key_ptr,
    value_ptr,
    pos_ptr,
    cs_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_out_ptr,
    q_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_ot,
    stride_oh,
    stride_qot,
    stride_qoh,
    n_q_heads,
    num_kv_heads,
    head_dim,
    ssq_ptr,
    stride_ssq,
    inv_n,
    eps,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FP8: tl.constexpr,
    K_OUT: tl.constexpr,
    Q_OUT: tl.constexpr,
    RMS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token: rotate its q heads (in place, pairs as `_rotary_kernel`; Q_OUT: into `q_out` instead, whole heads),
    and write its rotated k and its v to the cache slot (`K_OUT`: the rotated k also to `k_out`). k is not written
    back: each k element is rotated from itself and its partner in registers (`_rotated_rows`), which another warp
    may still be reading. q, k and v may be fp32 sums (the fp32 residual stream's QKV projection): they are rounded
    only where they are written. RMS (with Q_OUT): q, k and v are scaled by `rsqrt(ssq[t] * inv_n + eps)`, an
    RMSNorm's 1/rms that the QKV projection left to its consumer."""
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    pdl_launch(PDL)
    s = 1.0
    if RMS:
        s = tl.rsqrt(tl.load(ssq_ptr + t * stride_ssq) * inv_n + eps)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    rot = d < 2 * HALF
    if IS_NEOX:
        first = d < HALF
        j = tl.where(first, d, d - HALF)  # index into cos / sin
        p = tl.where(first, d + HALF, d - HALF)  # pair partner
    else:
        first = (d % 2) == 0
        j = d // 2
        p = tl.where(first, d + 1, d - 1)
    c = tl.load(cs_ptr + pos * stride_c + j, mask=rot, other=1.0).to(tl.float32)
    sn = tl.load(cs_ptr + pos * stride_c + HALF + j, mask=rot, other=0.0).to(tl.float32)
    if Q_OUT:
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        yq, mq = _rotated_rows(q_ptr + t * stride_qt, stride_qh, n_q_heads, hq, d, p, first, rot, c, sn, head_dim)
        if RMS:
            yq = yq * s
        tl.store(q_out_ptr + t * stride_qot + hq * stride_qoh + d, yq.to(q_out_ptr.dtype.element_ty), mask=mq)
    else:
        i1, i2, r_ok, cos, sin = rotary_pairs(cs_ptr + pos * stride_c, HALF, BLOCK_R, IS_NEOX)
        rotate_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, i1, i2, r_ok, cos, sin, BLOCK_H=BLOCK_HQ)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    y, mask = _rotated_rows(key_ptr + t * stride_kt, stride_kh, num_kv_heads, h, d, p, first, rot, c, sn, head_dim)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if RMS:
        y, v = y * s, v * s
    if K_OUT:
        tl.store(k_out_ptr + t * stride_ot + h * stride_oh + d, y.to(k_out_ptr.dtype.element_ty), mask=mask)
    if slot >= 0:
        store_kv(
            y,
            v,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            slot,
            h,
            d,
            mask,
            stride_kcb,
            stride_kco,
            stride_kch,
            stride_vcb,
            stride_vco,
            stride_vch,
            num_kv_heads,
            BLOCK_SIZE,
            FP8,
        )


def rotary_and_cache(
    q,
    key,
    value,
    positions,
    cos_sin_cache,
    head_dim,
    is_neox,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
    k_out=None,
    q_out=None,
    rms=None,
):
    """Triton `rotary_and_cache_ref`: `q` `[T, H, D]` rotated in place (returned), the rotated `key` and `value`
    `[T, Hkv, D]` scattered to their slots (slots < 0 skipped; `key` itself is left as it was). `k_out` `[T, Hkv, D]`
    (last dim contiguous): also gets every token's rotated key (with a slot or not), e.g. for attention over a
    step's own fresh prompts without reading them back from the cache. `q_out` `[T, H, D]`: the rotated q goes there
    (and is returned), `q` is only read; so q, k and v may be fp32 sums, rounded as they are written.
    `rms=(ssq, n, eps)` (with `q_out`; `ssq` fp32 `[T]`, any stride): q, k and v scaled by `rsqrt(ssq / n + eps)` as
    they are read: sums of a matmul whose input norm left its 1/rms to this kernel (`w4a16_mma(norm=)`)."""
    T, H, D = q.shape
    Hkv = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim <= head_dim == D and rot_dim % 2 == 0 and cos_sin_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_out is None or (k_out.shape == key.shape and k_out.stride(-1) == 1)
    assert q_out is None or (q_out.shape == q.shape and q_out.stride(-1) == 1)
    assert rms is None or (q_out is not None and rms[0].dtype == torch.float32 and rms[0].shape == (T,)), (
        'rms needs q_out and fp32 ssq [T]'
    )
    if T == 0:
        return q if q_out is None else q_out
    if k_cache.dtype == KV4_DTYPE:  # int4: this kernel rotates (no slot written), `reshape_and_cache_int4` writes
        kr = torch.empty(key.shape, dtype=key.dtype, device=key.device) if k_out is None else k_out
        none = torch.full_like(slot_mapping, -1)
        qo = rotary_and_cache(
            q,
            key,
            value,
            positions,
            cos_sin_cache,
            head_dim,
            is_neox,
            kr[None],
            kr[None],
            none,
            k_out=kr,
            q_out=q_out,
            rms=rms,
        )  # kr[None]: a stand-in cache, never written
        v = value if rms is None else value * torch.rsqrt(rms[0] / rms[1] + rms[2])[:, None, None]
        reshape_and_cache_int4(kr, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return qo
    fp8 = check_fp8_scales(k_cache, k_scale, v_scale)
    ko = key if k_out is None else k_out
    qo = q if q_out is None else q_out
    _rotary_and_cache_kernel[(T,)](
        q,
        key,
        value,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else key,
        v_scale if fp8 else value,
        ko,
        qo,
        q.stride(0),
        q.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ko.stride(0),
        ko.stride(1),
        qo.stride(0),
        qo.stride(1),
        H,
        Hkv,
        D,
        q if rms is None else rms[0],
        0 if rms is None else rms[0].stride(0),
        1.0 if rms is None else 1.0 / rms[1],
        0.0 if rms is None else rms[2],
        HALF=rot_dim // 2,
        BLOCK_R=triton.next_power_of_2(rot_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(H),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D),
        IS_NEOX=is_neox,
        FP8=fp8,
        K_OUT=k_out is not None,
        Q_OUT=q_out is not None,
        RMS=rms is not None,
        num_warps=4 if H * D >= 2048 else 1,
        **pdl_kw(q.device),
    )
    return qo
