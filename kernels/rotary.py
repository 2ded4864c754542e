"""Rotary position embedding applied in place to q and k: Triton kernel and plain-PyTorch reference.

`cos_sin_cache` is `[max_position, rot_dim]`: row `p` holds `cos(p * inv_freq)` (first `rot_dim/2` entries)
then `sin(p * inv_freq)`. The first `rot_dim <= head_dim` dims of every head are rotated, in pairs `(x1, x2)`:

    x1' = x1 cos - x2 sin,    x2' = x2 cos + x1 sin

NeoX / HF-Llama style pairs dim `i` with `i + rot_dim/2` (rotate halves); GPT-J style pairs `2i` with `2i+1`.
"""

import torch
import triton
import triton.language as tl

__all__ = ['apply_rotary', 'apply_rotary_ref']


def _pairs(rot_dim, is_neox, device):
    "Indices of the first and second element of each rotated pair."
    i = torch.arange(rot_dim // 2, device=device)
    return (i, i + rot_dim // 2) if is_neox else (2 * i, 2 * i + 1)


def _rotate_ref(x, cos, sin, head_dim, rot_dim, is_neox):
    shape = x.shape
    x = x.reshape(x.shape[0], -1, head_dim).float().clone()
    i1, i2 = _pairs(rot_dim, is_neox, x.device)
    x1, x2 = x[..., i1], x[..., i2]
    x[..., i1] = x1 * cos[:, None] - x2 * sin[:, None]
    x[..., i2] = x2 * cos[:, None] + x1 * sin[:, None]
    return x.reshape(shape)


def apply_rotary_ref(q, k, positions, cos_sin_cache, head_dim: int, is_neox: bool = True):
    "Rotated copies of `q` `[T, H*D]` (or `[T, H, D]`) and `k` (or None), computed in fp32."
    rot_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, : rot_dim // 2], cs[:, rot_dim // 2 :]
    qo = _rotate_ref(q, cos, sin, head_dim, rot_dim, is_neox).to(q.dtype)
    ko = None if k is None else _rotate_ref(k, cos, sin, head_dim, rot_dim, is_neox).to(k.dtype)
    return qo, ko


@triton.jit
def rotate_heads(x_ptr, stride_h, n_heads, i1, i2, r_ok, cos, sin, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < n_heads) & r_ok[None, :]
    p1 = x_ptr + h * stride_h + i1[None, :]
    p2 = x_ptr + h * stride_h + i2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_pairs(cs_row_ptr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, IS_NEOX: tl.constexpr):
    "The rotated pairs' indices `(i1, i2)`, their mask, and `cos`, `sin` `[1, BLOCK_R]` of one position's cache row."
    r = tl.arange(0, BLOCK_R)
    r_ok = r < HALF
    cos = tl.load(cs_row_ptr + r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row_ptr + HALF + r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    if IS_NEOX:
        i1 = r
        i2 = r + HALF
    else:
        i1 = 2 * r
        i2 = 2 * r + 1
    return i1, i2, r_ok, cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i1, i2, r_ok, cos, sin = rotary_pairs(cache_ptr + pos * stride_c, HALF, BLOCK_R, IS_NEOX)
    rotate_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, i1, i2, r_ok, cos, sin, BLOCK_H=BLOCK_HQ)
    if HAS_K:
        rotate_heads(k_ptr + t * stride_kt, stride_kh, n_k_heads, i1, i2, r_ok, cos, sin, BLOCK_H=BLOCK_HK)


def _strides(x, head_dim):
    "(token stride, head stride, num heads) of `[T, H*D]` or `[T, H, D]` with a contiguous head dim."
    if x.dim() == 2:
        assert x.stride(1) == 1
        return x.stride(0), head_dim, x.shape[1] // head_dim
    assert x.stride(2) == 1 and x.shape[2] == head_dim
    return x.stride(0), x.stride(1), x.shape[1]


def apply_rotary(q, k, positions, cos_sin_cache, head_dim: int, is_neox: bool = True):
    "Triton `apply_rotary_ref`, rotating `q` and `k` (may be None) in place; returns `(q, k)`."
    T = q.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim <= head_dim and rot_dim % 2 == 0 and cos_sin_cache.stride(-1) == 1
    if T == 0:
        return q, k
    sqt, sqh, hq = _strides(q, head_dim)
    skt, skh, hk = _strides(k, head_dim) if k is not None else (0, 0, 0)
    _rotary_kernel[(T,)](
        q,
        q if k is None else k,
        positions,
        cos_sin_cache,
        sqt,
        sqh,
        skt,
        skh,
        cos_sin_cache.stride(0),
        hq,
        hk,
        HALF=rot_dim // 2,
        BLOCK_R=triton.next_power_of_2(rot_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(max(hk, 1)),
        IS_NEOX=is_neox,
        HAS_K=k is not None,
        num_warps=4 if hq * rot_dim >= 2048 else 1,
    )
    return q, k
