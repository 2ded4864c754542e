"""Writing the paged KV cache: `reshape_and_cache` (K and V rows to their slots) with its PyTorch reference, and the
FP8 row quantization every cache write shares (`store_kv`, also used by `kv_cache_rotary.rotary_and_cache`, the
rotary embedding of q and k fused with that write: one launch per layer instead of two).

Layout (one layer): `k_cache`, `v_cache` `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
block `s // block_size`, offset `s % block_size`; slots < 0 (padding) are skipped.

FP8 KV cache (`kv_cache_dtype='fp8'`): the caches are `float8_e4m3fn` and every (token, KV head) row carries its
own fp32 scale in `k_scale` / `v_scale` `[num_blocks, block_size, num_kv_heads]` (contiguous), so slot `s`,
head `h` has its scale at `s * num_kv_heads + h`. A write quantizes each row with `scale = max|x| / 448`,
`x8 = clamp(x / scale, -448, 448)` (round to nearest even); a read (`paged_attention`) dequantizes `x8 * scale`.

Data flow: `key`/`value` `[T, Hkv, D]` + `slot_mapping` `[T]` -> `_reshape_and_cache_kernel` (one program per
token) -> `store_kv` -> `_store_row` per K and V (FP8: scale, `_round_to_e4m3`, cast) -> the caches (and scales).
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.kv_cache_int4 import KV4_DTYPE, quantize_kv4_ref, reshape_and_cache_int4, rotate_kv4

__all__ = [
    'reshape_and_cache',
    'reshape_and_cache_ref',
    'quantize_kv_ref',
    'check_fp8_scales',
    'FP8_MAX',
    'FP8_DTYPE',
    'SCALE_MIN',
    'store_kv',
]

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
    """`rows` into `cache [num_blocks, block_size, ..]` at `slots`; a cache whose blocks sit in larger pages (a view of
    a shared KV cache slot, `bind_kv_cache`) by block and offset."""
    if cache.dtype == FP8_DTYPE:  # CPU has no fp8 index_copy_: copy the bytes
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    rows = rows.to(cache.dtype)
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
    else:
        bs = cache.shape[1]
        cache[slots // bs, slots % bs] = rows


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write `key`/`value` `[T, Hkv, D]` into the caches at `slot_mapping` `[T]` (slots < 0 are skipped). FP8
    caches: each row is quantized with its own scale, written to `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, sc in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = x[keep]
        if cache.dtype == KV4_DTYPE:  # int4: packed codes and fp16 group scales (`kv_cache_int4`)
            x, s = quantize_kv4_ref(rotate_kv4(x.float()), x.shape[-1] // sc.shape[-1])
            _write_rows(sc, slots, s)
        elif cache.dtype == FP8_DTYPE:
            x, s = quantize_kv_ref(x)
            _write_rows(sc, slots, s)
        _write_rows(cache, slots, x)


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
def store_kv(
    k,
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
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    "Write one token's K and V rows `[BLOCK_H, BLOCK_D]` to cache slot `slot` (>= 0)."
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    _store_row(
        k,
        k_cache_ptr + blk * stride_kcb + off * stride_kco + h * stride_kch + d,
        k_scale_ptr,
        slot,
        h,
        d,
        mask,
        num_kv_heads,
        FP8,
    )
    _store_row(
        v,
        v_cache_ptr + blk * stride_vcb + off * stride_vco + h * stride_vch + d,
        v_scale_ptr,
        slot,
        h,
        d,
        mask,
        num_kv_heads,
        FP8,
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        store_kv(
            k,
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


def check_fp8_scales(k_cache, k_scale, v_scale):
    "True for an FP8 cache (whose scales must be contiguous fp32 `[num_blocks, block_size, Hkv]`)."
    if k_cache.dtype != FP8_DTYPE:
        return False
    for sc in (k_scale, v_scale):
        assert sc is not None and sc.dtype == torch.float32 and sc.is_contiguous() and sc.shape == k_cache.shape[:3], (
            'an FP8 cache needs contiguous fp32 scales [num_blocks, block_size, num_kv_heads]'
        )
    return True


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    "Triton `reshape_and_cache_ref`: scatter `key`/`value` `[T, Hkv, D]` to their slots (slots < 0 skipped)."
    T, Hkv, D = key.shape
    if T == 0:
        return
    if k_cache.dtype == KV4_DTYPE:
        return reshape_and_cache_int4(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = check_fp8_scales(k_cache, k_scale, v_scale)
    _reshape_and_cache_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else key,
        v_scale if fp8 else value,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        Hkv,
        D,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D),
        FP8=fp8,
        num_warps=4 if Hkv * D >= 1024 else 1,
    )
