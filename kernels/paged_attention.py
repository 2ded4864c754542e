"""Paged attention over a block-table KV cache: the launcher `paged_attention` (path, tile, split count and tuned
config), its plain-PyTorch reference `paged_attention_ref`, and the re-exported cache writes. The Triton kernels
themselves (the flash-attention recurrence, the split merge) are in `paged_attention_kernel`.

Layout (one layer):
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
  block `s // block_size`, offset `s % block_size`.
- A step's tokens are flattened (varlen): `q` is `[num_tokens, num_heads, head_dim]`; sequence `b` owns rows
  `query_start_loc[b]:query_start_loc[b+1]`, which are its *last* `q_len` positions out of `seq_lens[b]`
  (so cached-prefix tokens, chunked prefill and decode are the same case). Attention is causal.
- `block_tables[b, i]` is the physical block holding the sequence's tokens `i*block_size ... (i+1)*block_size-1`.

Kernels (one entry point, `paged_attention`, picks between two launches of the same kernel,
`paged_attention_kernel.paged_attention_kernel`):

| batch                          | grid                                      | one program                                  |
|--------------------------------|-------------------------------------------|----------------------------------------------|
| prefill / mixed                | `(num_tokens // BLOCK_Q + num_seqs, Hkv)` | BLOCK_Q query tokens x G heads, all its keys |
| decode (`max_query_len` <= 8)  | `(num_seqs, Hkv, num_splits)`             | a sequence's queries x G heads, 1/num_splits of the keys |

Decode splits a sequence's keys over `num_splits` programs (flash-decoding), whose partials a second launch
(`merge_splits_kernel`) merges. Grids depend only on `num_tokens`, `num_seqs` and static settings (the split count
comes from the `max_seq_len` bound); per-sequence lengths are read on the device, so launches can be captured in
CUDA graphs. The one-token decode path's tile, warps, stages and split policy are tuned data per batch bucket
(`decode_config`, `configs/paged_attention/<device>.json`, written by `benchmarks/kernels/tune_paged_attention.py`).

Data flow: `paged_attention(q, caches, query_start_loc, seq_lens, block_tables, ...)` -> path (`DECODE_MAX_QUERY_LEN`)
-> launch config (`decode_config` / `pick_decode_config`) and split count (`_default_num_splits`) -> the kernel
launch (-> the merge launch when split) -> `out [num_tokens, num_heads, head_dim]`.

FP8 KV cache (`kv_cache_dtype='fp8'`, written by `kv_cache`): the caches are `float8_e4m3fn` and every
(token, KV head) row carries its own fp32 scale in `k_scale` / `v_scale` `[num_blocks, block_size, num_kv_heads]`.
The cache writes (`reshape_and_cache` of `kv_cache`, `rotary_and_cache` of `kv_cache_rotary`) are re-exported here;
how the kernel reads the scales is told in `paged_attention_kernel`.

Int4 KV cache (`kv_cache_dtype='int4'`, `kv_cache_int4`): `uint8` caches `[num_blocks, block_size, Hkv, D // 2]` of
packed 4-bit codes and fp16 scales `[num_blocks, block_size, Hkv, D // group]`; the kernel dequantizes each K and V
tile as it loads it (constexpr `KV4`), the reference through `dequantize_kv4_ref`.

Logit soft-capping (`softcap`, Gemma 2's `attn_logit_softcapping`): each score becomes `cap * tanh(s / cap)`
before the causal / sliding-window mask and the softmax (in the kernel behind a constexpr flag, `SOFTCAP`).

Attention sinks (`sinks`, gpt-oss): one learned logit per query head, fp32 `[num_heads]`, joins every query's
softmax denominator as a key with no value: `out = sum_j e^(s_j) v_j / (e^(sink_h) + sum_j e^(s_j))`, so a head can
put weight on nothing. The sink is not scaled by the softmax scale (it is a logit already), and it is there whatever
the mask or window (in the kernel: the recurrence starts from `m = sink`, `l = 1` in split 0, constexpr `SINKS`).

Chunked local attention (`attention_chunk_size` C, Llama 4): positions are cut into chunks of C and a query at `p`
sees the keys `p // C * C .. p`, its own chunk up to itself. Like a sliding window it is a lower bound on the key
position, per query (`p // C * C` instead of `p - W + 1`); the kernel starts a tile's key loop at the chunk of its
first query and masks per row (constexpr `CHUNK`).
"""

import functools
import math

import torch
import triton

from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.tuned import configs_for
from cvllm_lab.kernels.kv_cache import (
    FP8_DTYPE,
    FP8_MAX,
    check_fp8_scales,
    quantize_kv_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from cvllm_lab.kernels.kv_cache_int4 import KV4_DTYPE, check_kv4_scales, dequantize_kv4_ref, rotate_kv4
from cvllm_lab.kernels.kv_cache_rotary import rotary_and_cache, rotary_and_cache_ref
from cvllm_lab.kernels.paged_attention_kernel import merge_splits_kernel, paged_attention_kernel
from cvllm_lab.kernels.pdl import pdl_kw

# the cache writes (`kv_cache`, `kv_cache_rotary`) are re-exported: callers find the whole paged-KV API here
__all__ = [
    'paged_attention',
    'paged_attention_ref',
    'decode_config',
    'pick_decode_config',
    'MIN_KEYS_PER_SPLIT',
    'reshape_and_cache',
    'reshape_and_cache_ref',
    'rotary_and_cache',
    'rotary_and_cache_ref',
    'quantize_kv_ref',
    'FP8_MAX',
    'FP8_DTYPE',
]
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def _dense_attention(q, k, v, qpos, kv_len, scale, sliding_window, softcap=None, sinks=None, chunk=None):
    """Masked attention of a padded batch in fp32: `q` `[B, H, M, D]`, `k`/`v` `[B, Hkv, L, D]`,
    `qpos` `[B, M]` absolute query positions, `kv_len` `[B]`. Returns `[B, H, M, D]` fp32.
    `softcap`: scores become `softcap * tanh(scores / softcap)` before the mask (Gemma 2). `sinks` `[H]`: one more
    logit per head in each softmax, whose value is zero (gpt-oss). `chunk`: a query sees only the keys of its own
    chunk of `chunk` positions (Llama 4's chunked local attention)."""
    B, H, M, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    kpos = torch.arange(L, device=q.device)
    mask = (kpos <= qpos[..., None]) & (kpos < kv_len[:, None, None])  # [B, M, L]
    if sliding_window is not None:
        mask &= kpos > qpos[..., None] - sliding_window
    if chunk is not None:
        mask &= kpos >= qpos[..., None] // chunk * chunk
    mask |= ~mask.any(-1, keepdim=True)  # padded query rows: attend anywhere, result is dropped
    # GQA without copying K/V: the G heads sharing a KV head become G*M rows of that head
    qg = q.float().reshape(B, Hkv, G * M, D)
    mg = mask[:, None, None].expand(B, 1, G, M, L).reshape(B, 1, G * M, L)
    if softcap or sinks is not None:  # SDPA has neither: scores, cap, mask, sink, softmax written out
        s = qg @ k.float().transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mg, float('-inf'))
        if sinks is not None:  # row (g, m) of KV head h is query head h * G + g
            sk = sinks.float().view(1, Hkv, G, 1, 1).expand(B, Hkv, G, M, 1).reshape(B, Hkv, G * M, 1)
            p = torch.cat([s, sk], -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        return (p @ v.float()).reshape(B, H, M, D)
    o = torch.nn.functional.scaled_dot_product_attention(qg, k.float(), v.float(), attn_mask=mg, scale=scale)
    return o.reshape(B, H, M, D)


def _gather_kv(cache, block_tables, n, scale=None):
    """Dense `[B, Hkv, n, D]` view of the first `n` tokens of each sequence (FP8 / int4: dequantized to fp32 with
    `scale`)."""
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    idx = block_tables[:, :nblk].long()
    g = cache[idx]  # [B, nblk, bs, Hkv, D] (int4: D // 2 bytes)
    if cache.dtype == KV4_DTYPE:
        g = dequantize_kv4_ref(g, scale[idx])
    elif scale is not None:
        g = g.float() * scale[idx][..., None]
    return g.reshape(g.shape[0], nblk * bs, *g.shape[3:])[:, :n].transpose(1, 2)


def _unrotate(o, out):
    "The output of attention over int4 (rotated) rows, rotated back (into `out` if given)."
    o = rotate_kv4(o, inverse=True)
    return o if out is None else out.copy_(o)


REF_SCORE_BUDGET = 1 << 26  # fp32 scores per query chunk of the reference's prefill path (256 MiB)


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    k_scale=None,
    v_scale=None,
    softcap: float | None = None,
    out=None,
    sinks=None,
    attention_chunk_size: int | None = None,
    _rotated: bool = False,
):
    """Causal attention of varlen queries over paged K/V; returns `[num_tokens, num_heads, head_dim]` (in `out` if given).
    Single-token queries (decode) are batched together; longer ones go one sequence at a time, in query
    chunks that keep the score matrix small. Rows past `query_start_loc[-1]` are zero. `max_query_len` and
    `max_seq_len` are accepted for parity with `paged_attention` and not needed here. FP8 caches are read
    through their per-row scales `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`. `softcap` (Gemma 2's
    `attn_logit_softcapping`): each score `s` becomes `softcap * tanh(s / softcap)`. `sinks` `[num_heads]` (gpt-oss):
    a learned logit per head added to every softmax's denominator. `attention_chunk_size` (Llama 4): a query at
    position `p` sees the keys from `p // C * C` to `p`, its own chunk."""
    C = attention_chunk_size
    if k_cache.dtype in (FP8_DTYPE, KV4_DTYPE):
        assert k_scale is not None and v_scale is not None, 'an FP8 / int4 cache needs its scales'
    if k_cache.dtype == KV4_DTYPE and not _rotated:  # int4 rows are rotated: attend with q rotated, rotate back
        o = paged_attention_ref(
            rotate_kv4(q),
            k_cache,
            v_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            scale,
            sliding_window,
            max_query_len,
            max_seq_len,
            k_scale,
            v_scale,
            softcap,
            sinks=sinks,
            attention_chunk_size=attention_chunk_size,
            _rotated=True,
        )
        return _unrotate(o, out)
    T, H, D = q.shape
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    B, dev = len(sl), q.device
    dst, out = out, q.new_zeros(T, H, D)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(B)]
    dec = [b for b in range(B) if q_lens[b] == 1 and sl[b] > 0]
    if dec:
        idx = torch.tensor(dec, device=dev)
        lens = seq_lens[idx].long()
        L = max(sl[b] for b in dec)
        rows = query_start_loc[idx].long()
        k = _gather_kv(k_cache, block_tables[idx], L, k_scale)
        v = _gather_kv(v_cache, block_tables[idx], L, v_scale)
        o = _dense_attention(
            q[rows][:, :, None], k, v, (lens - 1)[:, None], lens, scale, sliding_window, softcap, sinks, C
        )
        out[rows] = o[:, :, 0].to(q.dtype)
    for b in range(B):
        n = q_lens[b]
        if n <= 1 or sl[b] == 0:
            continue
        ctx = sl[b] - n
        chunk = max(1, REF_SCORE_BUDGET // (H * sl[b]))
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            L = ctx + e  # keys visible to the chunk's last query
            k = _gather_kv(k_cache, block_tables[b : b + 1], L, k_scale)
            v = _gather_kv(v_cache, block_tables[b : b + 1], L, v_scale)
            qpos = torch.arange(ctx + s, ctx + e, device=dev)[None]
            qc = q[qsl[b] + s : qsl[b] + e].transpose(0, 1)[None]  # [1, H, m, D]
            o = _dense_attention(
                qc, k, v, qpos, torch.tensor([L], device=dev), scale, sliding_window, softcap, sinks, C
            )
            out[qsl[b] + s : qsl[b] + e] = o[0].transpose(0, 1).to(q.dtype)
    return out if dst is None else dst.copy_(out)


# ---------------------------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_KEYS_PER_SPLIT = 256  # the runner's short-context decode graphs are captured with this `max_seq_len` bound


MAX_KV_SPLITS = 32  # the split count's cap; the merge kernel's compile-time width (one binary for all counts)


def decode_config(num_seqs: int, max_seq_len: int, head_dim: int, device: torch.device) -> dict:
    """The launch config of the one-token decode path (`configs/paged_attention/<device>.json`): `tile_n` keys per
    loop step, `num_warps`, `num_stages`, and the split-KV policy `min_keys` (keys per split at least, against the
    `max_seq_len` bound) and `waves` (programs aimed at, in multiples of the SMs). Tables `short` (bounds of at
    most `MIN_KEYS_PER_SPLIT` keys: the runner's short-context graphs) and `decode` are keyed `head_dim,bucket`;
    the entry of the largest bucket <= `num_seqs` is taken (`pick_decode_config`), and a head dim without one (or
    the Triton interpreter) takes `default`. Buckets are the runner's CUDA-graph batch sizes, so capturing the
    graphs compiles every binary the tables name."""
    T = configs_for('paged_attention', device)
    if _INTERPRET or device.type != 'cuda':
        return T['default']
    return pick_decode_config(T, num_seqs, max_seq_len, head_dim)


def pick_decode_config(tables: dict, num_seqs: int, max_seq_len: int, head_dim: int) -> dict:
    """`decode_config`'s choice among `tables` (as `tuned.load_configs` returns them): the nearest bucket at or
    below `num_seqs` of `decode` and, under a short bound, of `short`, which wins a tie."""
    names = ('short', 'decode') if max_seq_len <= MIN_KEYS_PER_SPLIT else ('decode',)
    found = [(b, name == 'short', name) for name in names for d, b in tables[name] if d == head_dim and b <= num_seqs]
    if not found:
        return tables['default']
    b, _, name = max(found)
    return tables[name][head_dim, b]


def _default_num_splits(
    q, num_seqs, num_kv_heads, max_seq_len, min_keys_per_split=MIN_KEYS_PER_SPLIT, max_splits=MAX_KV_SPLITS, waves=4
):
    "Enough KV splits for about `waves` waves of programs, each covering >= `min_keys_per_split` keys."
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 8
    want = triton.cdiv(waves * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, min_keys_per_split), max_splits))


DECODE_MAX_QUERY_LEN = 8  # batches whose longest query is at most this many tokens take the split-KV path


def paged_attention(
    q,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out=None,
    num_kv_splits: int | None = None,
    k_scale=None,
    v_scale=None,
    softcap: float | None = None,
    config: dict | None = None,
    sinks=None,
    attention_chunk_size: int | None = None,
    _rotated: bool = False,
):
    """Triton `paged_attention_ref` for mixed batches (prefill, chunked prefill, decode), GQA, fp32/fp16/bf16
    queries over a cache of the same dtype or FP8 (with `k_scale`/`v_scale` `[num_blocks, block_size, Hkv]`).

    `max_query_len` / `max_seq_len` are upper bounds read on the host (computed from the tensors, with a
    device sync, when None): they pick the decode path and the number of KV splits, so pass static values
    when capturing CUDA graphs. `num_kv_splits` overrides the split count of the decode path, `config` its tuned
    launch config (`decode_config`; queries of 2 to `DECODE_MAX_QUERY_LEN` tokens always take `default`).
    Batch-invariant mode (`batch_invariant`): the prefill path for every batch, so a row's keys are summed in the same
    tiles, in the same order, whatever the batch and the chunking (`kv_start` is tile-aligned; masked tiles add
    exact zeros). `sinks`: fp32 `[num_heads]` attention-sink logits (gpt-oss), `attention_chunk_size`: chunked
    local attention (Llama 4), as in the reference."""
    T, H, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    assert H % Hkv == 0, (H, Hkv)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = check_fp8_scales(k_cache, k_scale, v_scale)
    kv4 = check_kv4_scales(k_cache, k_scale, v_scale)  # int4: packed codes, a scale per group of the head dim
    if kv4 and not _rotated:  # int4 rows are rotated: attend with q rotated, rotate the output back
        o = paged_attention(
            rotate_kv4(q),
            k_cache,
            v_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            scale,
            sliding_window,
            max_query_len,
            max_seq_len,
            None,
            num_kv_splits,
            k_scale,
            v_scale,
            softcap,
            config,
            sinks,
            attention_chunk_size,
            _rotated=True,
        )
        return _unrotate(o, out)
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())

    G = H // Hkv
    G_P = triton.next_power_of_2(G)
    D_P = max(16, triton.next_power_of_2(D))
    fp32 = q.dtype == torch.float32
    dot_f32 = _INTERPRET and q.dtype == torch.bfloat16
    precision = 'ieee' if fp32 or dot_f32 else 'tf32'  # 'tf32' is ignored for 16-bit inputs
    qk_scale = scale * math.log2(math.e)
    # batch-invariant mode: every row on the one-pass path (no split-KV by batch size, one tile for every batch)
    decode = max_query_len <= DECODE_MAX_QUERY_LEN and not batch_invariant()
    if decode:
        # two compile-time query tiles only (one token, or up to DECODE_MAX_QUERY_LEN): a step's last short prefill
        # chunk, or a prompt cached but for a few tokens, must not compile a new binary mid-serving
        block_q = 1 if max_query_len <= 1 else DECODE_MAX_QUERY_LEN
        block_m = max(16, block_q * G_P)
        cfg = config or (
            decode_config(B, max_seq_len, D_P, q.device)
            if block_q == 1
            else configs_for('paged_attention', q.device)['default']
        )
        splits = num_kv_splits or _default_num_splits(q, B, Hkv, max_seq_len, cfg['min_keys'], waves=cfg['waves'])
        grid = (B, Hkv, splits)
        tile_n = min(cfg['tile_n'], 32) if fp32 or D_P > 128 else cfg['tile_n']  # fp32 / wide heads: registers
        warps, stages = cfg['num_warps'], (2 if fp32 else cfg['num_stages'])
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
    paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        query_start_loc,
        seq_lens,
        block_tables,
        k_scale if fp8 or kv4 else q,
        v_scale if fp8 or kv4 else q,
        q if sinks is None else sinks.float().contiguous(),
        qk_scale,
        float(softcap or 1.0),
        B,
        D,
        Hkv,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        H * splits,
        splits,
        QUERIES_PER_KV=G,
        G_P=G_P,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM_P=D_P,
        PAGE=page,
        TILE_N=tile_n,
        WINDOW=sliding_window or 0,
        CHUNK=attention_chunk_size or 0,
        DIRECT=decode,
        SPLIT=split,
        PRECISION=precision,
        DOT_F32=dot_f32,
        FP8_KV=fp8,
        KV4=kv4,
        KV4_GROUP=D // k_scale.shape[-1] if kv4 else 1,
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=warps,
        num_stages=stages,
        **pdl_kw(q.device),
    )
    if split:
        merge_splits_kernel[(T, H)](
            out,
            part_acc,
            part_m,
            part_l,
            splits,
            D,
            out.stride(0),
            out.stride(1),
            H * splits,
            splits,
            SPLITS_P=max(MAX_KV_SPLITS, triton.next_power_of_2(splits)),
            HEAD_DIM_P=D_P,
            num_warps=4 if D_P >= 128 else 2,
            **pdl_kw(q.device),
        )
    return out
