"""The 4-bit KV cache (`kv_cache_dtype='int4'`): its layout, the quantization and dequantization references, and the
Triton cache write (`reshape_and_cache_int4`, called by `kv_cache.reshape_and_cache` for a `uint8` cache).

Layout (one layer; the chapter is `nbs/44a_kv4.ipynb`):
- `k_cache`, `v_cache`: `uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2]`, two 4-bit codes per byte:
  element `2j` in the low nibble of byte `j`, element `2j + 1` in the high nibble.
- `k_scale`, `v_scale`: `float16 [num_blocks, block_size, num_kv_heads, head_dim // group]` (contiguous): one scale
  per `group` consecutive elements of a (token, KV head) row; `group = KV4_GROUP` (32) or the head dim if smaller.
  The group size is not stored: it is `head_dim // k_scale.shape[-1]`.

Rotation (TurboQuant-style): every row is multiplied by a fixed orthogonal `R = kv4_rotation(D)` before it is
quantized (`x R`), and attention runs in the rotated basis: `(q R) . (k R) = q . k`, and the output
`sum_j p_j (v_j R) = o R` is rotated back by `R^T`. `R` is a Walsh-Hadamard matrix (blocks of the largest power of 2
dividing D, 128 at most) after a fixed pattern of sign flips of the input elements, scaled to be orthogonal: it spreads an outlier channel
over the whole block, so one large channel no longer sets the scale of its group. The writes rotate before
quantizing; `paged_attention` (and its reference) rotates q and rotates the output back.

Quantization (symmetric, per group): `scale = max(max|x| / 7, 2^-14)` rounded to fp16 (the value stored), code
`c = clamp(round(x / scale), -8, 7) + 8` in 0..15; dequantization `(c - 8) * scale`. Rounding is half to even in
both the reference and the kernel, so the two write the same bytes.
"""

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    'KV4_DTYPE',
    'KV4_GROUP',
    'KV4_SCALE_DTYPE',
    'KV4_SCALE_MIN',
    'kv4_group',
    'kv4_rotation',
    'rotate_kv4',
    'quantize_kv4_ref',
    'dequantize_kv4_ref',
    'check_kv4_scales',
    'reshape_and_cache_int4',
    'kv4_tile',
]

KV4_DTYPE = torch.uint8  # the cache's storage dtype: two codes per byte
KV4_GROUP = 32  # elements of the head dim per scale
KV4_SCALE_DTYPE = torch.float16
KV4_SCALE_MIN = 2.0**-14  # the smallest normal fp16: a group's scale floor (an all-zero group must not divide by 0)
_KV4_SCALE_MIN = tl.constexpr(KV4_SCALE_MIN)


@functools.lru_cache(maxsize=None)
def _rotation(D: int, device: str) -> torch.Tensor:
    b = min(D & -D, 128)  # the block: the largest power of 2 dividing D, at most 128
    H = torch.ones(1, 1)
    while H.shape[0] < b:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    sign = 1.0 - 2.0 * ((torch.arange(D) * 2654435761 >> 7) % 2).float()  # a fixed, irregular pattern of signs
    return (sign[:, None] * torch.block_diag(*[H] * (D // b)) / b**0.5).to(device)  # diag(sign) H: x R = (x * sign) H


def kv4_rotation(D: int, device='cpu') -> torch.Tensor:
    """The fixed orthogonal fp32 `[D, D]` that int4 rows are rotated by before quantization (built on the CPU and
    kept per device: `bind_kv_cache` makes it before any CUDA graph is captured, so a capture only reads it)."""
    device = torch.device(device)
    if device.type == 'cuda' and device.index is None:  # one key per GPU: 'cuda' and 'cuda:0' are the same tensor
        device = torch.device('cuda', torch.cuda.current_device())
    return _rotation(D, str(device))


def rotate_kv4(x, inverse: bool = False):
    "`x [..., D]` times `kv4_rotation(D)` (or its transpose), in fp32, back in `x`'s dtype."
    R = kv4_rotation(x.shape[-1], x.device)
    return (x.float() @ (R.T if inverse else R)).to(x.dtype)


def kv4_group(head_dim: int) -> int:
    "Elements per scale for `head_dim`: `KV4_GROUP`, or the whole (even) head dim when it is smaller or not a multiple."
    if head_dim % 2:
        raise ValueError(f'the int4 KV cache needs an even head_dim, got {head_dim}')
    return KV4_GROUP if head_dim % KV4_GROUP == 0 else head_dim


def quantize_kv4_ref(x, group: int | None = None):
    """Rows `x [..., D]` (already rotated, in the cache) -> (`uint8 [..., D // 2]` packed codes, fp16 scales
    `[..., D // group]`)."""
    D = x.shape[-1]
    group = group or kv4_group(D)
    xg = x.float().unflatten(-1, (D // group, group))
    scale = (xg.abs().amax(-1) / 7).clamp_min(KV4_SCALE_MIN).to(KV4_SCALE_DTYPE)
    c = (torch.round(xg / scale.float()[..., None]).clamp(-8, 7) + 8).to(torch.uint8).flatten(-2)
    return c[..., 0::2] | (c[..., 1::2] << 4), scale


def dequantize_kv4_ref(packed, scale, dtype=torch.float32):
    "Inverse of `quantize_kv4_ref`: packed codes `[..., D // 2]` and scales `[..., D // group]` -> `[..., D]`."
    c = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).float() - 8
    D = c.shape[-1]
    s = scale.float().repeat_interleave(D // scale.shape[-1], -1)
    return (c * s).to(dtype)


def check_kv4_scales(k_cache, k_scale, v_scale):
    "True for an int4 cache (whose scales must be contiguous fp16 `[num_blocks, block_size, Hkv, D // group]`)."
    if k_cache.dtype != KV4_DTYPE:
        return False
    for sc in (k_scale, v_scale):
        assert (
            sc is not None
            and sc.dtype == KV4_SCALE_DTYPE
            and sc.is_contiguous()
            and sc.shape[:3] == k_cache.shape[:3]
            and (2 * k_cache.shape[3]) % sc.shape[3] == 0
        ), 'an int4 cache needs contiguous fp16 scales [num_blocks, block_size, num_kv_heads, head_dim // group]'
    return True


@triton.jit
def kv4_tile(
    cache_ptr,
    row_off,  # [TILE_N] element offset of each key's (block, slot, KV head) row in the cache
    scale_ptr,
    sc_row,  # [TILE_N] index of each row's first scale
    n_ok,  # [TILE_N] keys in range
    half_dim,  # head_dim // 2: bytes of a row
    n_groups,  # scales of a row
    TILE_N: tl.constexpr,
    HALF_P: tl.constexpr,  # bytes of a row, padded to a power of 2 (HEAD_DIM_P // 2)
    GROUP: tl.constexpr,  # elements per scale
):
    """A paged-attention tile of int4 rows, dequantized: fp32 `[TILE_N, 2 * HALF_P]`. The packed bytes are loaded
    whole (one wide load per row, not a byte per element), split into their nibbles and interleaved back into element
    order; each group of GROUP elements is scaled by its row's scale (a reshape, not a gather per element). Padding
    and keys out of range are 0."""
    offs_j = tl.arange(0, HALF_P)
    b = tl.load(
        cache_ptr + row_off[:, None] + offs_j[None, :],
        mask=n_ok[:, None] & (offs_j < half_dim)[None, :],
        other=0x88,  # codes 8 and 8: the value 0
    )
    lo = (b & 15).to(tl.int32) - 8
    hi = (b >> 4).to(tl.int32) - 8
    c = tl.interleave(lo, hi).to(tl.float32)  # element 2j from the low nibble of byte j, 2j + 1 from the high one
    if (2 * HALF_P) % GROUP == 0:  # whole groups (GROUP a power of 2): one scale per group through a reshape
        NG_P: tl.constexpr = 2 * HALF_P // GROUP
        offs_g = tl.arange(0, NG_P)
        sc = tl.load(
            scale_ptr + sc_row[:, None] + offs_g[None, :],
            mask=n_ok[:, None] & (offs_g < n_groups)[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.reshape(tl.reshape(c, [TILE_N, NG_P, GROUP]) * sc[:, :, None], [TILE_N, 2 * HALF_P])
    else:  # one group of a head dim that is not a power of 2: one scale per row
        sc = tl.load(scale_ptr + sc_row, mask=n_ok, other=0.0).to(tl.float32)
        x = c * sc[:, None]
    return x


@triton.jit
def _store_row4(
    x_ptr,
    stride_xt,
    stride_xh,
    t,
    cache_ptr,
    scale_ptr,
    slot,
    head_dim,
    num_kv_heads,
    stride_cb,
    stride_co,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NG_P: tl.constexpr,
    GROUP: tl.constexpr,
    HALF_P: tl.constexpr,
):
    # one token's rows [BLOCK_H, NG_P groups, GROUP / 2 pairs]: even and odd elements loaded apart, packed in pairs
    h = tl.arange(0, BLOCK_H)[:, None, None]
    g = tl.arange(0, NG_P)[None, :, None]
    e = tl.arange(0, HALF_P)[None, None, :]
    col = g * GROUP + 2 * e  # the pair's even element
    ok = (h < num_kv_heads) & (e < GROUP // 2) & (col < head_dim)
    src = x_ptr + t * stride_xt + h * stride_xh + col
    x0 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + 1, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x0), 2), tl.max(tl.abs(x1), 2))  # [BLOCK_H, NG_P]
    scale = tl.maximum(tl.math.div_rn(amax, 7.0), _KV4_SCALE_MIN).to(tl.float16)
    ng = head_dim // GROUP
    hg = tl.arange(0, BLOCK_H)[:, None]
    gg = tl.arange(0, NG_P)[None, :]
    tl.store(scale_ptr + (slot * num_kv_heads + hg) * ng + gg, scale, mask=(hg < num_kv_heads) & (gg < ng))
    s = scale.to(tl.float32)[:, :, None]
    # round half to even (as torch.round): add and subtract 1.5 * 2^23 in fp32
    c0 = (tl.math.div_rn(x0, s) + 12582912.0) - 12582912.0
    c1 = (tl.math.div_rn(x1, s) + 12582912.0) - 12582912.0
    c0 = (tl.minimum(tl.maximum(c0, -8.0), 7.0) + 8.0).to(tl.int32)
    c1 = (tl.minimum(tl.maximum(c1, -8.0), 7.0) + 8.0).to(tl.int32)
    byte = (c0 | (c1 << 4)).to(tl.uint8)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    tl.store(cache_ptr + blk * stride_cb + off * stride_co + h * stride_ch + col // 2, byte, mask=ok)


@triton.jit
def _reshape_and_cache_int4_kernel(
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
    NG_P: tl.constexpr,
    GROUP: tl.constexpr,
    HALF_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _store_row4(
            key_ptr,
            stride_kt,
            stride_kh,
            t,
            k_cache_ptr,
            k_scale_ptr,
            slot,
            head_dim,
            num_kv_heads,
            stride_kcb,
            stride_kco,
            stride_kch,
            BLOCK_SIZE,
            BLOCK_H,
            NG_P,
            GROUP,
            HALF_P,
        )
        _store_row4(
            value_ptr,
            stride_vt,
            stride_vh,
            t,
            v_cache_ptr,
            v_scale_ptr,
            slot,
            head_dim,
            num_kv_heads,
            stride_vcb,
            stride_vco,
            stride_vch,
            BLOCK_SIZE,
            BLOCK_H,
            NG_P,
            GROUP,
            HALF_P,
        )


def reshape_and_cache_int4(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    "Quantize `key`/`value` `[T, Hkv, D]` to 4 bits and scatter them to their slots (slots < 0 skipped)."
    T, Hkv, D = key.shape
    if T == 0:
        return
    check_kv4_scales(k_cache, k_scale, v_scale)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = D // k_scale.shape[-1]
    key, value = rotate_kv4(key.float()), rotate_kv4(value.float())  # fp32: quantized from the unrounded product
    _reshape_and_cache_int4_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
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
        NG_P=triton.next_power_of_2(D // group),
        GROUP=group,
        HALF_P=triton.next_power_of_2(group // 2),
        num_warps=4 if Hkv * D >= 1024 else 1,
    )
