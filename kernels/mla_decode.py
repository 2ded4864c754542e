"""Multi-head latent attention (MLA, DeepSeek V2/V3) over a paged latent cache: the cache write and the absorbed
decode, Triton kernels and their plain-PyTorch references.

Layout (one layer): `kv_cache [num_blocks, block_size, L + R]`, one row per token holding the compressed latent
`c_kv` (`L = kv_lora_rank` values, already RMS-normed) followed by the RoPE'd shared key `k_pe` (`R =
qk_rope_head_dim`). Token slot `s` lives at block `s // block_size`, offset `s % block_size`; slots < 0 are skipped.

Absorbed decode: with `W_UK` folded into the query, head h's query is `q_lat_h = q_nope_h W_UK_h` (`[L]`) next to its
RoPE part `q_pe_h` (`[R]`), and every head attends to the *same* rows of the cache (multi-query attention with a
576-wide key whose first 512 values are also the value):

    s_hj = (q_lat_h . c_j + q_pe_h . kpe_j) * scale,   o_lat_h = sum_j softmax_j(s_hj) c_j      (`[L]`)

`W_UV` is applied by the caller afterwards. The kernel packs `BLOCK_H` heads into the rows of one tile, so a tile
of latent rows is read once for all of them, and splits a sequence's keys over `num_splits` programs
(flash-decoding) with the same log2-unit online softmax as `paged_attention`:

| launch | grid | one program |
|---|---|---|
| `_mla_decode_kernel` | `(num_seqs, cdiv(H, BLOCK_H), num_splits)` | BLOCK_H heads x 1/num_splits of the keys -> `(m, l, acc)` |
| `_mla_merge_kernel` (num_splits > 1) | `(num_seqs, H)` | `out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s` |

FP8 latent cache (`kv_cache_dtype='fp8'`, the dense cache's convention of `kernels.kv_cache`): `kv_cache` is
`float8_e4m3fn` and every token's row carries one fp32 scale in `kv_scale [num_blocks, block_size]` (contiguous: slot
`s` at `s`, the dense layout with its one "KV head"). A write quantizes the whole row `[c_kv | k_pe]` with `scale =
max|row| / 448`; the decode kernel folds the scale into the fp32 scores (`s_j = (q . row8_j) * ks_j`) and dequantizes
the value tile (`c8_j * ks_j`, in fp32, then q's dtype) as `paged_attention` does.

Grids depend only on `num_seqs`, `H` and the `max_seq_len` bound, so the launches can be captured in CUDA graphs.
Launch configs (tile, warps, stages, split policy) per batch bucket are data: `configs/mla_decode/<device>.json`,
written by `benchmarks/kernels/tune_mla_decode.py`.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.kv_cache import FP8_DTYPE, _FP8_MAX, _SCALE_MIN, _round_to_e4m3, quantize_kv_ref
from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.tuned import configs_for

__all__ = [
    'concat_and_cache_mla',
    'concat_and_cache_mla_ref',
    'mla_decode',
    'mla_decode_ref',
    'decode_config',
    'check_mla_fp8_scale',
    'dequantize_latent',
]

from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------


def check_mla_fp8_scale(kv_cache, kv_scale) -> bool:
    "True for an FP8 latent cache (whose scale must be contiguous fp32 `[num_blocks, block_size]`)."
    if kv_cache.dtype != FP8_DTYPE:
        return False
    assert (
        kv_scale is not None
        and kv_scale.dtype == torch.float32
        and kv_scale.is_contiguous()
        and kv_scale.shape == kv_cache.shape[:2]
    ), 'an FP8 latent cache needs contiguous fp32 scales [num_blocks, block_size]'
    return True


def dequantize_latent(rows, scale, dtype=torch.float32):
    "Latent rows `[..., L + R]` of an FP8 cache times their scales `[...]` (`scale` None: the rows as they are), in `dtype`."
    return rows.to(dtype) if scale is None else (rows.float() * scale[..., None]).to(dtype)


def concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None):
    """Write rows `[kv_c | k_pe]` (`[T, L]`, `[T, R]`) into `kv_cache [num_blocks, block_size, L + R]` at
    `slot_mapping`. FP8 cache: each row quantized with its own scale, written to `kv_scale [num_blocks, block_size]`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], -1)[keep]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if check_mla_fp8_scale(kv_cache, kv_scale):
        rows, s = quantize_kv_ref(rows[:, None])
        kv_scale.view(-1).index_copy_(0, slots, s[:, 0])
        flat, rows = flat.view(torch.uint8), rows[:, 0].view(torch.uint8)  # CPU has no fp8 index_copy_: copy the bytes
    flat.index_copy_(0, slots, rows.to(flat.dtype))


def mla_decode_ref(
    q_nope, q_pe, kv_cache, seq_lens, block_tables, scale, max_seq_len: int | None = None, kv_scale=None
):
    """Absorbed MLA decode in fp32: `q_nope [B, H, L]` (query already multiplied by `W_UK`), `q_pe [B, H, R]`, each
    sequence's last query against its `seq_lens[b]` cached rows (FP8: dequantized with `kv_scale`). Returns the
    latent output `[B, H, L]` in q's dtype. `max_seq_len` is accepted for parity with `mla_decode`, not needed here."""
    B, H, L = q_nope.shape
    bs = kv_cache.shape[1]
    n = int(seq_lens.max()) if B else 0
    nblk = -(-n // bs)
    idx = block_tables[:, :nblk].long()
    sc = kv_scale[idx] if check_mla_fp8_scale(kv_cache, kv_scale) else None
    rows = dequantize_latent(kv_cache[idx], sc).reshape(B, nblk * bs, -1)[:, :n]  # [B, n, L + R] fp32
    q = torch.cat([q_nope, q_pe], -1).float()
    s = q @ rows.transpose(1, 2) * scale  # [B, H, n]
    s = s.masked_fill(torch.arange(n, device=q.device) >= seq_lens[:, None, None], float('-inf'))
    return (s.softmax(-1) @ rows[..., :L]).to(q_nope.dtype)


# ---------------------------------------------------------------------------------------------------------------
# concat_and_cache_mla
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def fp8_row_scale(amax):
    "A row's FP8 scale from its `max|x|`: `max(amax, SCALE_MIN) / 448` (IEEE division, as the reference)."
    return tl.math.div_rn(tl.maximum(amax, _SCALE_MIN), _FP8_MAX)


@triton.jit
def fp8_quantize(x, scale):
    "fp32 `x / scale` clamped to +-448 and rounded to the nearest e4m3 value (still fp32: the cast that follows is exact)."
    return _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX))


@triton.jit
def store_latent_row(c, pe, cache_ptr, scale_ptr, slot, row, L, offs_l, l_ok, i_pe, pe_ok, FP8: tl.constexpr):
    """Store one token's latent row `[c (at offs_l) | pe (at L + i_pe)]` at `row`; FP8: quantized with one scale for
    the whole row, `max|row| / 448`, stored at `scale_ptr + slot` (masked-off lanes must hold 0)."""
    if FP8:
        c = c.to(tl.float32)
        pe = pe.to(tl.float32)
        scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(c), 0), tl.max(tl.max(tl.abs(pe), 1), 0)))
        tl.store(scale_ptr + slot, scale)
        c = fp8_quantize(c, scale)
        pe = fp8_quantize(pe, scale)
    tl.store(row + offs_l, c.to(cache_ptr.dtype.element_ty), mask=l_ok)
    tl.store(row + L + i_pe, pe.to(cache_ptr.dtype.element_ty), mask=pe_ok)


@triton.jit
def _concat_and_cache_kernel(
    c_ptr,
    pe_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    stride_ct,
    stride_pt,
    stride_cb,
    stride_co,
    L,
    R,
    PAGE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_co
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)[None, :]
        c = tl.load(c_ptr + t * stride_ct + offs_l, mask=offs_l < L, other=0.0)
        pe = tl.load(pe_ptr + t * stride_pt + offs_r, mask=offs_r < R, other=0.0)
        store_latent_row(c, pe, cache_ptr, scale_ptr, slot, row, L, offs_l, offs_l < L, offs_r, offs_r < R, FP8)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None):
    "Triton `concat_and_cache_mla_ref` (one program per token; rows may be strided views with a contiguous last dim)."
    T, L = kv_c.shape
    k_pe = k_pe.reshape(T, -1)
    R = k_pe.shape[1]
    assert kv_cache.shape[-1] == L + R and kv_cache.stride(-1) == 1 and kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1
    fp8 = check_mla_fp8_scale(kv_cache, kv_scale)
    if T == 0:
        return
    _concat_and_cache_kernel[(T,)](
        kv_c,
        k_pe,
        kv_cache,
        kv_scale if fp8 else kv_c,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        L,
        R,
        PAGE=kv_cache.shape[1],
        BLOCK_L=triton.next_power_of_2(L),
        BLOCK_R=triton.next_power_of_2(R),
        FP8=fp8,
        num_warps=4 if L >= 256 else 1,
    )


# ---------------------------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['stride_bt', 'min_tiles'])
def _mla_decode_kernel(
    qn_ptr,
    qp_ptr,
    cache_ptr,
    scale_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    H,
    L,
    R,
    stride_qnb,
    stride_qnh,
    stride_qpb,
    stride_qph,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_co,
    stride_bt,
    min_tiles,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    h_ok = heads < H
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok, r_ok = offs_l < L, offs_r < R
    seq64 = seq.to(tl.int64)
    qn = tl.load(
        qn_ptr + seq64 * stride_qnb + heads[:, None] * stride_qnh + offs_l[None, :],
        mask=h_ok[:, None] & l_ok[None, :],
        other=0.0,
    )
    qp = tl.load(
        qp_ptr + seq64 * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits), min_tiles)  # short: fewer splits busy
    lo = split * tiles_per_split * TILE_N
    hi = tl.minimum(lo + tiles_per_split * TILE_N, seq_len)

    m_i = tl.full([BLOCK_H], float('-inf'), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = block_tables_ptr + seq64 * stride_bt
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < hi
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE) * stride_co
        c = tl.load(cache_ptr + row[:, None] + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :], other=0.0)
        pe = tl.load(cache_ptr + row[:, None] + L + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if FP8_KV:  # exact casts: every e4m3 value is a bf16/fp16/fp32 value
            ks = tl.load(scale_ptr + blk * PAGE + offs_n % PAGE, mask=n_ok, other=0.0)
            c8 = c
            c = c8.to(qn.dtype)
            pe = pe.to(qn.dtype)
        if DOT_F32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(qn, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(qp, tl.trans(pe), s, input_precision=PRECISION) * qk_scale  # [BLOCK_H, TILE_N], log2 units
        if FP8_KV:
            s = s * ks[None, :]  # q . (row8 * ks) = (q . row8) * ks
            c = (c8.to(tl.float32) * ks[:, None]).to(qn.dtype)  # the value tile, dequantized in fp32
        s = tl.where(n_ok[None, :], s, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)  # the latent is the value
        m_i = m_new

    if SPLIT:  # unnormalized partials at [seq, head, split]; an idle split writes only m = -inf, l = 0
        ph = seq64 * H * num_splits + heads * num_splits + split
        tl.store(part_m_ptr + ph, m_i, mask=h_ok)
        tl.store(part_l_ptr + ph, l_i, mask=h_ok)
        if lo < hi:
            tl.store(part_acc_ptr + ph[:, None] * BLOCK_L + offs_l[None, :], acc, mask=h_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq64 * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & l_ok[None, :],
        )


@triton.jit(do_not_specialize=['num_splits'])
def _mla_merge_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    H,
    L,
    num_splits,
    stride_ob,
    stride_oh,
    SPLITS_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    s_ok = offs_s < num_splits
    base = (seq * H + h) * num_splits + offs_s
    m = tl.load(part_m_ptr + base, mask=s_ok, other=float('-inf'))
    l = tl.load(part_l_ptr + base, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float('-inf'), 0.0, m_max))
    l_tot = tl.sum(w * l, 0)
    offs_l = tl.arange(0, BLOCK_L)
    busy = s_ok & (l > 0.0)  # idle splits left their acc unwritten
    acc = tl.load(part_acc_ptr + base[:, None] * BLOCK_L + offs_l[None, :], mask=busy[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + seq * stride_ob + h * stride_oh + offs_l, out.to(out_ptr.dtype.element_ty), mask=offs_l < L)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_config(num_seqs: int, device: torch.device) -> dict:
    """The launch config of `mla_decode` for `num_seqs` sequences: the `decode` table's entry of the largest
    bucket <= num_seqs in `configs/mla_decode/<device>.json` (`interpret` under the Triton interpreter). Fields:
    `tile_n` keys per loop step, `num_warps`, `num_stages`, and the split-KV policy `min_keys` (keys per split at
    least: against the `max_seq_len` bound for the grid, and against the actual length inside the kernel, where a
    short sequence leaves its later splits idle) and `waves` (programs aimed at, in multiples of the SMs)."""
    T = configs_for('mla_decode', device)
    if _INTERPRET or device.type != 'cuda':
        return T['interpret']
    table = T['default']
    if batch_invariant():  # one config for every batch (the smallest bucket's)
        return table[min(table)]
    return table[max([b for b in table if b <= num_seqs], default=min(table))]


def _num_splits(q, num_seqs, head_blocks, max_seq_len, cfg, max_splits=32):
    "About `waves` waves of programs, each covering >= `min_keys` keys of the `max_seq_len` bound."
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 8
    want = triton.cdiv(cfg['waves'] * sms, max(1, num_seqs * head_blocks))
    return max(1, min(want, triton.cdiv(max_seq_len, cfg['min_keys']), max_splits))


def mla_decode(
    q_nope,
    q_pe,
    kv_cache,
    seq_lens,
    block_tables,
    scale,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out=None,
    config: dict | None = None,
    kv_scale=None,
):
    """Triton `mla_decode_ref`: `q_nope [B, H, L]`, `q_pe [B, H, R]` (last dims contiguous), `kv_cache
    [num_blocks, block_size, L + R]` of q's dtype or FP8 (with `kv_scale [num_blocks, block_size]`) -> `[B, H, L]`.
    `max_seq_len` (an upper bound, read on the host;
    computed with a sync when None) sets the number of KV splits; `num_kv_splits` overrides it, `config` the tuned
    launch config (`decode_config`). Batch-invariant mode: one config, no split."""
    B, H, L = q_nope.shape
    R = q_pe.shape[-1]
    _, page, W = kv_cache.shape
    assert W == L + R and q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1 and kv_cache.stride(-1) == 1
    fp8 = check_mla_fp8_scale(kv_cache, kv_scale)
    if out is None:
        out = torch.empty(B, H, L, dtype=q_nope.dtype, device=q_nope.device)
    if B == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    cfg = config or decode_config(B, q_nope.device)
    fp32 = q_nope.dtype == torch.float32
    dot_f32 = _INTERPRET and q_nope.dtype == torch.bfloat16  # the interpreter mis-multiplies bf16 dots
    block_h = 16 if H <= 16 or fp32 else 32
    head_blocks = triton.cdiv(H, block_h)
    block_l = triton.next_power_of_2(L)
    # batch-invariant mode: no split-KV (the split count follows the batch size)
    splits = num_kv_splits or (1 if batch_invariant() else _num_splits(q_nope, B, head_blocks, max_seq_len, cfg))
    tile_n = min(cfg['tile_n'], 16) if fp32 or block_l > 512 else cfg['tile_n']  # fp32 tiles: registers
    if splits > 1:
        part_m = torch.empty(B, H, splits, dtype=torch.float32, device=q_nope.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, H, splits, block_l, dtype=torch.float32, device=q_nope.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _mla_decode_kernel[(B, head_blocks, splits)](
        q_nope,
        q_pe,
        kv_cache,
        kv_scale if fp8 else q_nope,
        out,
        part_acc,
        part_m,
        part_l,
        seq_lens,
        block_tables,
        scale * math.log2(math.e),
        H,
        L,
        R,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        1 if num_kv_splits or splits == 1 else triton.cdiv(cfg['min_keys'], tile_n),  # tiles per split at least
        BLOCK_H=block_h,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        PAGE=page,
        TILE_N=tile_n,
        SPLIT=splits > 1,
        PRECISION='ieee' if fp32 or dot_f32 else 'tf32',
        DOT_F32=dot_f32,
        FP8_KV=fp8,
        num_warps=cfg['num_warps'] if block_h * block_l <= 8192 else max(8, cfg['num_warps']),
        num_stages=cfg['num_stages'],
    )
    if splits > 1:
        _mla_merge_kernel[(B, H)](
            out,
            part_acc,
            part_m,
            part_l,
            H,
            L,
            splits,
            out.stride(0),
            out.stride(1),
            SPLITS_P=triton.next_power_of_2(splits),
            BLOCK_L=block_l,
            num_warps=4,
        )
    return out
