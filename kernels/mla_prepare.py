"""MLA's per-token preparation in one launch: RMSNorm of the latent, RoPE of the shared key and of every head's
query RoPE part, and the cache write (`mla_rope_norm_cache`), with its plain-PyTorch reference.

After the projections a step has `q [T, H, P + R]` and `latent [T, L + R] = [c_kv | k_pe]` (both unrotated, the
latent not normed). Three launches would follow (`rms_norm` of `c_kv`, `apply_rotary` of `q_pe` and `k_pe`,
`concat_and_cache_mla`); `_prepare_kernel` does them per token in one program:

    q[t, :, P:]            <- rope(q[t, :, P:], positions[t])                      (in place)
    kv_cache[slot_mapping[t]] = [rms_norm(c_kv[t]) * weight | rope(k_pe[t])]       (slot < 0: no write)

Numerics as the three kernels it replaces (fp32 inside, stored in the cache's / q's dtype). An FP8 cache
(`kv_scale [num_blocks, block_size]`) gets the row quantized with one scale, as `concat_and_cache_mla` does.
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.mla_decode import check_mla_fp8_scale, concat_and_cache_mla_ref, fp8_quantize, fp8_row_scale
from cvllm_lab.kernels.norm import rms_norm_ref
from cvllm_lab.kernels.rotary import apply_rotary_ref, rotary_pairs, rotate_heads

__all__ = ['mla_rope_norm_cache', 'mla_rope_norm_cache_ref']


def mla_rope_norm_cache_ref(
    q, latent, positions, cos_sin_cache, norm_weight, eps, kv_cache, slot_mapping, P: int, is_neox: bool, kv_scale=None
):
    "`q [T, H, P + R]` rotated in place; `[rms_norm(latent[:, :L]) | rope(latent[:, L:])]` written at `slot_mapping`."
    L = kv_cache.shape[-1] - q.shape[-1] + P
    R = q.shape[-1] - P
    q_pe, k_pe = apply_rotary_ref(q[..., P:], latent[:, L:], positions, cos_sin_cache, R, is_neox)
    q[..., P:] = q_pe
    concat_and_cache_mla_ref(rms_norm_ref(latent[:, :L], norm_weight, eps), k_pe, kv_cache, slot_mapping, kv_scale)


@triton.jit
def _prepare_kernel(
    q_ptr,
    lat_ptr,
    pos_ptr,
    cs_ptr,
    w_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    eps,
    H,
    L,
    stride_qt,
    stride_qh,
    stride_lt,
    stride_c,
    stride_cb,
    stride_co,
    P: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PAGE: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i1, i2, r_ok, cos, sin = rotary_pairs(cs_ptr + pos * stride_c, HALF, BLOCK_R, IS_NEOX)
    rotate_heads(q_ptr + t * stride_qt + P, stride_qh, H, i1, i2, r_ok, cos, sin, BLOCK_H=BLOCK_H)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_co
        lat = lat_ptr + t * stride_lt
        offs = tl.arange(0, BLOCK_L)
        ok = offs < L
        c = tl.load(lat + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        c = c * tl.rsqrt(tl.sum(c * c, 0) / L + eps) * w
        k1 = tl.load(lat + L + i1[None, :], mask=r_ok[None, :], other=0.0).to(tl.float32)
        k2 = tl.load(lat + L + i2[None, :], mask=r_ok[None, :], other=0.0).to(tl.float32)
        y1 = tl.where(r_ok[None, :], k1 * cos - k2 * sin, 0.0)
        y2 = tl.where(r_ok[None, :], k2 * cos + k1 * sin, 0.0)
        if FP8:  # one scale for the whole row [c | k_pe]
            scale = fp8_row_scale(
                tl.maximum(
                    tl.maximum(tl.max(tl.abs(c), 0), tl.max(tl.max(tl.abs(y1), 1), 0)), tl.max(tl.max(tl.abs(y2), 1), 0)
                )
            )
            tl.store(scale_ptr + slot, scale)
            c, y1, y2 = fp8_quantize(c, scale), fp8_quantize(y1, scale), fp8_quantize(y2, scale)
        tl.store(row + offs, c.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(row + L + i1[None, :], y1.to(cache_ptr.dtype.element_ty), mask=r_ok[None, :])
        tl.store(row + L + i2[None, :], y2.to(cache_ptr.dtype.element_ty), mask=r_ok[None, :])


def mla_rope_norm_cache(
    q, latent, positions, cos_sin_cache, norm_weight, eps, kv_cache, slot_mapping, P: int, is_neox: bool, kv_scale=None
):
    """Triton `mla_rope_norm_cache_ref`: `q [T, H, P + R]` (head dim contiguous), `latent [T, L + R]` (last dim
    contiguous, rows may be strided), `cos_sin_cache [max_pos, R]`, `kv_cache [num_blocks, block_size, L + R]`."""
    T, H, D = q.shape
    R = D - P
    L = kv_cache.shape[-1] - R
    assert q.stride(-1) == 1 and latent.stride(-1) == 1 and kv_cache.stride(-1) == 1 and latent.shape[1] == L + R
    assert cos_sin_cache.shape[-1] == R and cos_sin_cache.stride(-1) == 1
    fp8 = check_mla_fp8_scale(kv_cache, kv_scale)
    if T == 0:
        return
    _prepare_kernel[(T,)](
        q,
        latent,
        positions,
        cos_sin_cache,
        norm_weight,
        kv_cache,
        kv_scale if fp8 else latent,
        slot_mapping,
        eps,
        H,
        L,
        q.stride(0),
        q.stride(1),
        latent.stride(0),
        cos_sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        P=P,
        HALF=R // 2,
        BLOCK_R=triton.next_power_of_2(R // 2),
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_L=triton.next_power_of_2(L),
        PAGE=kv_cache.shape[1],
        IS_NEOX=is_neox,
        FP8=fp8,
        num_warps=4 if H * R >= 1024 or L >= 256 else 1,
    )
