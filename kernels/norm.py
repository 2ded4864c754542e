"""RMSNorm and fused residual-add + RMSNorm: Triton kernels and plain-PyTorch references.

`rms_norm(x) = x / sqrt(mean(x^2) + eps) * weight`, one program per row, computed in fp32 and written in the
input dtype. The fused variant first forms `new_residual = x + residual` (rounded to the residual dtype, as an
unfused model would store it) and normalizes that.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait

__all__ = ['rms_norm', 'rms_norm_ref', 'fused_add_rms_norm', 'fused_add_rms_norm_ref']


def rms_norm_ref(x, weight, eps: float = 1e-6):
    "RMSNorm over the last dim in fp32; output in `x.dtype`."
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6):
    "Returns `(rms_norm(x + residual), x + residual)`."
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(new_residual, weight, eps).to(x.dtype), new_residual


@triton.jit(do_not_specialize=['n_rows'])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_xi,
    inner,
    stride_r,
    stride_o,
    stride_ro,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (offs < n_cols)[None, :]
    w = tl.load(w_ptr + offs, mask=offs < n_cols, other=0.0).to(tl.float32)  # a weight: safe before the wait
    pdl_wait(PDL)
    pdl_launch(PDL)
    x_rows = (rows // inner) * stride_x + (rows % inner) * stride_xi  # x: rows of [outer, inner, n_cols]
    x = tl.load(x_ptr + x_rows[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_ro + offs[None, :], x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(t):
    "2-D `[rows, hidden]` view (copies only if the last dim is strided)."
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _x_rows(x):
    """`x` as `(tensor, outer stride, inner stride, inner)`: row r at `(r // inner) * outer + (r % inner) * inner_stride`.
    A 3-D `[T, heads, head_dim]` slice of a wider buffer (QK-norm on q out of the fused qkv output) is read in
    place; anything else as 2-D rows."""
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return x, x.stride(0), x.stride(1), x.shape[1]
    x2 = _rows(x)
    return x2, x2.stride(0), 0, 1


def _launch(x, residual, weight, eps, out, res_out):
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    if residual is None:
        x2, sx, sxi, inner = _x_rows(x)
    else:
        x2 = _rows(x)
        sx, sxi, inner = x2.stride(0), 0, 1
    r2 = _rows(residual) if residual is not None else x2
    o2, ro2 = out.view(-1, n), (res_out.view(-1, n) if res_out is not None else out.view(-1, n))
    m = o2.shape[0]
    if m == 0:
        return
    # short rows (QK-norm's head_dim rows) are packed several to a program: one row of 128 values per program
    # leaves most of a warp's loads idle and needs hundreds of thousands of programs
    rows = max(1, min(16, 2048 // block, triton.next_power_of_2(m)))
    _rms_norm_kernel[(triton.cdiv(m, rows),)](
        x2,
        r2,
        weight,
        o2,
        ro2,
        sx,
        sxi,
        inner,
        r2.stride(0),
        o2.stride(0),
        ro2.stride(0),
        m,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK=block,
        **pdl_kw(x2.device),
        num_warps=min(16, max(1, rows * block // 256)),
    )


def rms_norm(x, weight, eps: float = 1e-6, out=None):
    "Triton `rms_norm_ref` over the last dim of `x` (any leading shape)."
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x, residual, weight, eps: float = 1e-6, inplace: bool = False):
    """Triton `fused_add_rms_norm_ref`: returns `(normed, new_residual)`. With `inplace`, `normed` is
    written into `x` and `new_residual` into `residual`."""
    if inplace:
        assert x.is_contiguous() and residual.is_contiguous()
        out, res_out = x, residual
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty(residual.shape, dtype=residual.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out
