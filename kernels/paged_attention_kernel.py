"""The Triton kernels of paged attention: `paged_attention_kernel` (causal attention of a tile of varlen queries over
paged K/V) and `merge_splits_kernel` (the flash-decoding merge of its split-KV partials). `paged_attention` (in
`paged_attention`) chooses the grid, tile, split count and launch config and launches them; the cache layout and the
varlen batch are described there.

The G = num_heads / num_kv_heads query heads sharing a KV head are packed into the rows of one tile, so each
K/V tile is read once per KV head. Keys are visited tile by tile through the block table with the
flash-attention recurrence, in fp32 and in log2 units (`s = q.k * scale * log2(e)`):

    m' = max(m, max_j s_j),   a = 2^(m - m'),   l' = a l + sum_j 2^(s_j - m'),   acc' = a acc + sum_j 2^(s_j - m') v_j

and `out = acc / l`. Decode splits a sequence's keys over `num_splits` programs (flash-decoding); each writes
its `(m, l, acc)` and a merge kernel computes `out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`,
`M = max_s m_s` (a separate kernel: having the last split program merge instead would put a chain of L2 round
trips, its loop over the splits' partials, at the end of every sequence).

Data flow: `q [T, H, D]`, the paged caches (and FP8 scales), `query_start_loc`, `seq_lens`, `block_tables` ->
`paged_attention_kernel` -> `out [T, H, D]`, or (`SPLIT`) partials `m`, `l` `[T, H, splits]` and `acc`
`[T, H, splits, HEAD_DIM_P]` -> `merge_splits_kernel` -> `out`.

FP8 KV cache: the attention kernel folds the key scales into the fp32 scores, `s_j = (q . k8_j) * ks_j` (the same
sum, one multiply per score), and dequantizes each V tile in fp32 before `P @ V`, which runs in q's dtype.

Int4 KV cache (`KV4`): element `d` of a cached row is the nibble `d % 2` of byte `d // 2`, a code `c` in 0..15 whose
value is `(c - 8) * scale[d // KV4_GROUP]` (fp16 scales per group of the head dim, at `(slot * Hkv + head) * NG`).
Each K and V tile is dequantized in fp32 as it is loaded, cast to q's dtype, and the dots run as for a
bf16 cache: the scales vary along the head dim, so they cannot be folded into the scores as FP8's are.

Attention sinks (`SINKS`, gpt-oss): a per-head logit in the denominator only. Split 0 starts its recurrence from
`m = sink * log2(e)`, `l = 1`, `acc = 0` (a key of score `sink` and value 0), the other splits from `-inf, 0, 0`, so
the merge needs nothing new.

Chunked local attention (`CHUNK`, Llama 4): a query at `p` sees the keys from `p // CHUNK * CHUNK`, its own chunk;
the key loop starts at the chunk of the tile's first query and each row masks the keys before its chunk.

Logit soft-capping (`SOFTCAP`): the kernel applies `cap * tanh(s / cap)` to the log2-unit scores as
`cap log2(e) tanh(s / (cap log2(e)))`, the same map, behind a constexpr flag (no cost when off).
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.kv_cache_int4 import kv4_tile
from cvllm_lab.kernels.pdl import pdl_launch, pdl_wait

__all__ = ['paged_attention_kernel', 'merge_splits_kernel']


# per-step metadata, not specialized on its values or its pointers' alignment: a call over a slice of the step's
# sequences (`DecodeSplit`) passes views that start at any int32 offset, and must not compile another binary
_META = ['qsl_ptr', 'seq_lens_ptr', 'block_tables_ptr']


@triton.jit(
    do_not_specialize=['num_seqs', 'stride_bt', 'stride_pt', 'stride_ph'] + _META, do_not_specialize_on_alignment=_META
)
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,  # FP8 cache: fp32 scale per (slot, KV head), at slot * num_kv_heads + head
    sinks_ptr,  # SINKS only: one logit per query head (natural units)
    qk_scale,  # softmax scale * log2(e): scores live in log2 units so that exp() becomes exp2()
    softcap,  # logit soft-cap (SOFTCAP only), in natural units
    num_seqs,
    head_dim,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    QUERIES_PER_KV: tl.constexpr,  # G = num_heads // num_kv_heads
    G_P: tl.constexpr,  # G rounded up to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile, >= BLOCK_Q * G_P (row r = token r // G_P, head r % G_P)
    HEAD_DIM_P: tl.constexpr,
    PAGE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window (0: off)
    CHUNK: tl.constexpr,  # chunked local attention: a query sees its own chunk of CHUNK positions (0: off)
    DIRECT: tl.constexpr,  # program 0-axis index == sequence index (every q_len <= BLOCK_Q)
    SPLIT: tl.constexpr,  # write unnormalized partials for merge_splits_kernel instead of the output
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast bf16 dot operands (the Triton interpreter mis-multiplies bf16)
    FP8_KV: tl.constexpr,  # float8_e4m3fn caches with per-row scales; dots run in q's dtype
    KV4: tl.constexpr,  # int4 caches: uint8 [.., D // 2] packed codes, fp16 scales per KV4_GROUP elements
    KV4_GROUP: tl.constexpr,
    SOFTCAP: tl.constexpr,  # tanh soft-capping of the scores (Gemma 2)
    SINKS: tl.constexpr,  # a learned per-head logit in every softmax's denominator (gpt-oss)
    PDL: tl.constexpr,
):
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
        if KV4:
            n_groups = head_dim // KV4_GROUP
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)

        # --- key range: causal end of the tile's last query, sliding-window start of its first ---------------
        kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
        kv_start = 0
        if WINDOW > 0:
            kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
        if CHUNK > 0:  # the chunk of the tile's first query (later queries' chunks start no earlier)
            kv_start = tl.maximum(kv_start, (ctx_len + q_tile * BLOCK_Q) // CHUNK * CHUNK)
        kv_start = (kv_start // TILE_N) * TILE_N
        # this program's share, in whole tiles (split == 0 of 1 takes everything)
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), num_splits)
        lo_n = kv_start + split * tiles_per_split * TILE_N
        hi_n = tl.minimum(lo_n + tiles_per_split * TILE_N, kv_end)

        # --- online softmax: m = running row max, l = running sum of exp2(s - m), acc = sum exp2(s - m) v ------
        m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        if SINKS:  # the sink as a first key of value 0, counted once: in split 0
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_i = tl.where(row_ok & (split == 0), sink, m_i)
            l_i = tl.where(row_ok & (split == 0), 1.0, l_i)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo_n, hi_n, TILE_N):
            offs_n = start + tl.arange(0, TILE_N)
            n_ok = offs_n < hi_n
            # each key's physical block through the block table (a tile may span several pages)
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            page_off = offs_n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            if KV4:  # packed bytes loaded whole, dequantized in the tile: (code - 8) * its group's scale
                sc_row = ((blk * PAGE + page_off) * num_kv_heads + kvh) * n_groups  # the row's first scale
                k = kv4_tile(
                    k_cache_ptr, blk * stride_kb + page_off * stride_ko + kvh * stride_kh, k_scale_ptr, sc_row, n_ok,
                    head_dim // 2, n_groups, TILE_N, HEAD_DIM_P // 2, KV4_GROUP,
                ).to(q.dtype)  # fmt: skip
            else:
                k = tl.load(
                    k_cache_ptr + (blk * stride_kb + page_off * stride_ko + kvh * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_mask,
                    other=0.0,
                )
            if FP8_KV:
                k = k.to(q.dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
                scale_idx = (blk * PAGE + page_off) * num_kv_heads + kvh
                k_scale = tl.load(k_scale_ptr + scale_idx, mask=n_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
            if FP8_KV:
                s = s * k_scale[None, :]  # q . (k8 * ks) = (q . k8) * ks
            if SOFTCAP:  # cap * tanh(x / cap) on natural-unit scores x = s / log2(e), back in log2 units;
                # tanh(y) = 1 - 2 / (e^2y + 1) saturates to +-1 without inf / inf; applied before the mask
                s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 / softcap)) + 1.0))
            visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
            if CHUNK > 0:
                visible = visible & (offs_n[None, :] >= (q_pos // CHUNK * CHUNK)[:, None])
            s = tl.where(visible, s, float('-inf'))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)  # fully masked row so far: avoid inf - inf
            alpha = tl.math.exp2(m_i - m_safe)  # rescale of the old sums to the new max
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV4:
                v = kv4_tile(
                    v_cache_ptr, blk * stride_vb + page_off * stride_vo + kvh * stride_vh, v_scale_ptr, sc_row, n_ok,
                    head_dim // 2, n_groups, TILE_N, HEAD_DIM_P // 2, KV4_GROUP,
                ).to(q.dtype)  # fmt: skip
            else:
                v = tl.load(
                    v_cache_ptr + (blk * stride_vb + page_off * stride_vo + kvh * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_mask,
                    other=0.0,
                )
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
            # partial results of this split; merge_splits_kernel rescales them to a common max
            ph = token * stride_pt + head * stride_ph + split
            tl.store(part_m_ptr + ph, m_i, mask=row_ok)
            tl.store(part_l_ptr + ph, l_i, mask=row_ok)
            tl.store(part_acc_ptr + ph[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )


@triton.jit(do_not_specialize=['num_splits', 'stride_pt', 'stride_ph'])
def merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_splits,
    head_dim,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    SPLITS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PDL: tl.constexpr,
):
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
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)
