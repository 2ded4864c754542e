"""The GGUF block formats as stored (q4_0 ... q6_k, f16/bf16/f32): type names, sizes and a PyTorch dequantizer.

A GGUF tensor `[rows, cols]` is stored row by row, each row a run of fixed-size block structs of `QK` weights
(32 for the legacy types, 256 for the k-quants) as small integers plus a few fp16 scales; a quantized weight here is
exactly those bytes, `uint8 [rows, bytes_per_row]`. Notebook 45 (`cvllm_lab.quant.gguf`) describes every struct and
adds the quantizers and `GGUFLinear`.

`dequantize` is the reference the Triton kernels (`gguf_matmul`) are tested against: each `_deq_*` takes the block
structs as `uint8 [n_blocks, type_size]` and returns fp32 `[n_blocks, QK]`, in the same floating-point order as
`gguf.quants` (scale products first, then the offset), so the results match it bit for bit. `gguf_levels` reads the
four types that repack into the W4A16 layout (group 32) as levels, scales and offsets. Plain PyTorch (no Triton).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES

__all__ = [
    'GT',
    'QUANT_TYPES',
    'FLOAT_TYPES',
    'SUPPORTED_TYPES',
    'FLOAT_DTYPES',
    'PACKED_TYPES',
    'parse_qtype',
    'block_info',
    'bytes_per_row',
    'as_bytes',
    'dequantize',
    'gguf_levels',
]

GT = GGMLQuantizationType
QUANT_TYPES = (GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K)
FLOAT_TYPES = (GT.F32, GT.F16, GT.BF16)
SUPPORTED_TYPES = QUANT_TYPES + FLOAT_TYPES
_BY_KEY = {t.name.replace('_', '').upper(): t for t in SUPPORTED_TYPES}


def parse_qtype(q) -> GGMLQuantizationType:
    "Map `q4_0`/`Q4_K`/`q4k`/`f16`/`bf16`, a `GGMLQuantizationType` or its int value to a supported `GGMLQuantizationType`."
    if isinstance(q, GGMLQuantizationType):
        t = q
    elif isinstance(q, (int, np.integer)):
        t = GGMLQuantizationType(int(q))
    elif isinstance(q, str):
        t = _BY_KEY.get(q.strip().replace('_', '').upper())
        if t is None:
            raise ValueError(f'unknown GGUF quantization type {q!r}; supported: {[s.name for s in SUPPORTED_TYPES]}')
    else:
        raise TypeError(f"can't parse a quantization type from {type(q).__name__}")
    if t not in SUPPORTED_TYPES:
        raise ValueError(f'GGUF type {t.name} is not supported here')
    return t


def block_info(qtype) -> tuple[int, int]:
    "`(weights per block, bytes per block)` of `qtype`."
    return GGML_QUANT_SIZES[parse_qtype(qtype)]


def bytes_per_row(qtype, cols: int) -> int:
    "Bytes of one quantized row of `cols` weights."
    qk, ts = block_info(qtype)
    if cols % qk:
        raise ValueError(f'{parse_qtype(qtype).name} needs a row length divisible by {qk}, got {cols}')
    return cols // qk * ts


def _f16(b: torch.Tensor) -> torch.Tensor:
    "fp16 stored little-endian in the 2 trailing bytes of `b` `[..., 2]` -> fp32 `[...]`."
    return b.contiguous().view(torch.float16)[..., 0].float()


def _shifts(*vals, shape, device) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8, device=device).view(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    "`[n, 16]` bytes -> `[n, 32]`: low nibbles then high nibbles (the legacy 4/5-bit order)."
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    "`[n, 4]` little-endian bytes of a u32 -> its 32 bits `[n, 32]` (uint8), bit `j` at column `j`."
    return ((qh[:, :, None] >> _shifts(*range(8), shape=(1, 1, 8), device=qh.device)) & 1).reshape(len(qh), 32)


def _deq_q4_0(b):
    d, q = _f16(b[:, :2]), _nibbles(b[:, 2:18])
    return d[:, None] * (q.float() - 8)


def _deq_q4_1(b):
    d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:20])
    return d[:, None] * q.float() + m[:, None]


def _deq_q5_0(b):
    d, q = _f16(b[:, :2]), _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return d[:, None] * (q.float() - 16)


def _deq_q5_1(b):
    d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return d[:, None] * q.float() + m[:, None]


def _deq_q8_0(b):
    return _f16(b[:, :2])[:, None] * b[:, 2:34].contiguous().view(torch.int8).float()


def _crumbs(qs, n_halves):
    "2-bit fields: byte `32*h + l` bit pair `j` -> element `128*h + 32*j + l`; `[n, 32*n_halves]` -> `[n, 128*n_halves]`."
    n = len(qs)
    return ((qs.reshape(n, n_halves, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1), device=qs.device)) & 3).reshape(
        n, -1
    )


def _deq_q2_k(b):
    n = len(b)
    sc, q = b[:, :16], _crumbs(b[:, 16:80], 2).reshape(n, 16, 16).float()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d[:, None] * (sc & 15).float())[:, :, None]
    ml = (dmin[:, None] * (sc >> 4).float())[:, :, None]
    return (dl * q - ml).reshape(n, 256)


def _q3k_scales(s):
    "12 bytes -> 16 signed 6-bit scales: low nibbles from bytes 0-7 (low then high half), top 2 bits from bytes 8-11."
    n = len(s)
    lo = torch.cat([s[:, :8] & 15, s[:, :8] >> 4], dim=-1)
    hi = ((s[:, 8:12].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1), device=s.device)) & 3).reshape(n, 16)
    return (lo | (hi << 4)).float() - 32


def _deq_q3_k(b):
    n = len(b)
    hbit = ((b[:, :32].reshape(n, 1, 32) >> _shifts(*range(8), shape=(1, 8, 1), device=b.device)) & 1).reshape(n, 256)
    q = _crumbs(b[:, 32:96], 2).float() - 4 * (1 - hbit.float())
    dl = _f16(b[:, 108:110])[:, None] * _q3k_scales(b[:, 96:108])
    return (dl[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def _q4k_scales(s):
    "12 bytes -> (8 scales, 8 mins), 6 bits each: 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 split over bytes 8-11 and the top 2 bits."
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _nibbles_k(qs):
    "q4_k/q5_k order: byte `32*c + l` -> elements `64*c + l` (low) and `64*c + 32 + l` (high); `[n,128]` -> `[n,8,32]`."
    n = len(qs)
    return ((qs.reshape(n, 4, 1, 32) >> _shifts(0, 4, shape=(1, 1, 2, 1), device=qs.device)) & 15).reshape(n, 8, 32)


def _deq_q4_k(b):
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _q4k_scales(b[:, 4:16])
    q = _nibbles_k(b[:, 16:144]).float()
    return ((d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]).reshape(n, 256)


def _deq_q5_k(b):
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _q4k_scales(b[:, 4:16])
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(*range(8), shape=(1, 8, 1), device=b.device)) & 1
    q = (_nibbles_k(b[:, 48:176]) | (qh << 4)).float()
    return ((d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]).reshape(n, 256)


def _deq_q6_k(b):
    n = len(b)
    lo = ((b[:, :128].reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1), device=b.device)) & 15).reshape(n, 256)
    q = (lo | (_crumbs(b[:, 128:192], 2) << 4)).float() - 32
    dl = _f16(b[:, 208:210])[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()
    return (dl[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


_DEQ = {
    GT.Q4_0: _deq_q4_0,
    GT.Q4_1: _deq_q4_1,
    GT.Q5_0: _deq_q5_0,
    GT.Q5_1: _deq_q5_1,
    GT.Q8_0: _deq_q8_0,
    GT.Q2_K: _deq_q2_k,
    GT.Q3_K: _deq_q3_k,
    GT.Q4_K: _deq_q4_k,
    GT.Q5_K: _deq_q5_k,
    GT.Q6_K: _deq_q6_k,
}
FLOAT_DTYPES = {GT.F32: torch.float32, GT.F16: torch.float16, GT.BF16: torch.bfloat16}


def as_bytes(raw) -> torch.Tensor:
    "A GGUF tensor's block bytes (numpy array or torch tensor) as a `uint8` torch tensor."
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    if raw.dtype != torch.uint8:
        raise TypeError(f'expected uint8 block bytes, got {raw.dtype}')
    return raw


def dequantize(raw, qtype, shape=None, dtype=torch.float32, chunk_weights: int = 1 << 24) -> torch.Tensor:
    "Block bytes `raw` `uint8 [..., bytes_per_row]` -> weights `[..., cols]` (or `shape`) in `dtype`."
    t, raw = parse_qtype(qtype), as_bytes(raw)
    qk, ts = GGML_QUANT_SIZES[t]
    if raw.shape[-1] % ts:
        raise ValueError(f'{t.name}: {raw.shape[-1]} bytes per row is not a multiple of {ts}')
    cols = raw.shape[-1] // ts * qk
    rows = raw.reshape(-1, raw.shape[-1])
    if t in FLOAT_DTYPES:
        out = rows.contiguous().view(FLOAT_DTYPES[t]).to(dtype)
    else:
        out = torch.empty(len(rows), cols, dtype=dtype, device=raw.device)
        step = max(1, chunk_weights // max(cols, 1))
        for r in range(0, len(rows), step):  # row chunks (each many blocks), only to bound memory
            blk = rows[r : r + step].reshape(-1, ts)
            out[r : r + step] = _DEQ[t](blk).reshape(-1, cols).to(dtype)
    return out.reshape(*(shape if shape is not None else (*raw.shape[:-1], cols)))


PACKED_TYPES = (GT.Q4_0, GT.Q4_1, GT.Q4_K, GT.Q8_0)


def gguf_levels(raw, qtype):
    "Block bytes `[N, bytes_per_row]` of q4_0/q4_1/q4_k/q8_0 -> levels `uint8 [N, K]`, scale and offset `fp32 [N, K/32]`."
    t, raw = parse_qtype(qtype), as_bytes(raw)
    qk, ts = GGML_QUANT_SIZES[t]
    N = raw.shape[0]
    b = raw.reshape(-1, ts)
    if t == GT.Q4_0:
        d = _f16(b[:, :2])[:, None]
        q, s, o = _nibbles(b[:, 2:18]), d, -8 * d
    elif t == GT.Q4_1:
        q, s, o = _nibbles(b[:, 4:20]), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    elif t == GT.Q8_0:
        d = _f16(b[:, :2])[:, None]
        q, s, o = (b[:, 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d, -128 * d
    elif t == GT.Q4_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = _q4k_scales(b[:, 4:16])
        q, s, o = _nibbles_k(b[:, 16:144]), d * sc, -(dmin * mn)
    else:
        raise ValueError(f'{t.name} has no packed form; packed types: {[p.name for p in PACKED_TYPES]}')
    return q.reshape(N, -1), s.reshape(N, -1), o.reshape(N, -1)
