"""Paged attention over a block-table KV cache: plain-PyTorch references (the contract every kernel meets).

Layout (one layer):
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
  block `s // block_size`, offset `s % block_size`.
- A step's tokens are flattened (varlen): `q` is `[num_tokens, num_heads, head_dim]`; sequence `b` owns rows
  `query_start_loc[b]:query_start_loc[b+1]`, which are its *last* `q_len` positions out of `seq_lens[b]`
  (so cached-prefix tokens, chunked prefill and decode are the same case). Attention is causal.
- `block_tables[b, i]` is the physical block holding the sequence's tokens `i*block_size ... (i+1)*block_size-1`.
"""
import torch

__all__ = ['reshape_and_cache_ref', 'paged_attention_ref']


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping):
    "Write `key`/`value` `[T, Hkv, D]` into the caches at `slot_mapping` `[T]` (slots < 0 are skipped)."
    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                        sliding_window: int | None = None, max_query_len: int | None = None,
                        max_seq_len: int | None = None):
    "Causal attention of varlen queries over paged K/V; returns `[num_tokens, num_heads, head_dim]`."
    T, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    qsl = query_start_loc.tolist()
    sl = seq_lens.tolist()
    B = len(sl)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(B)]
    mq = max_query_len or max(q_lens)
    mk = max_seq_len or max(sl)
    nblk = (mk + bs - 1) // bs
    dev = q.device
    # gather K/V for every sequence, padded to `mk` tokens: [B, nblk*bs, Hkv, D] -> [B, Hkv, mk, D]
    bt = block_tables[:, :nblk].long()
    k = k_cache[bt].reshape(B, nblk * bs, Hkv, D)[:, :mk].transpose(1, 2)
    v = v_cache[bt].reshape(B, nblk * bs, Hkv, D)[:, :mk].transpose(1, 2)
    # scatter queries into a padded [B, H, mq, D] batch
    rows = torch.cat([torch.arange(n, device=dev) for n in q_lens])
    bidx = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(q_lens, device=dev))
    qp = q.new_zeros(B, mq, H, D)
    qp[bidx, rows] = q
    qp = qp.transpose(1, 2)
    # absolute position of each padded query row, and the causal (+ window, + length) mask
    sl_t, ql_t = torch.tensor(sl, device=dev), torch.tensor(q_lens, device=dev)
    qpos = (sl_t - ql_t)[:, None] + torch.arange(mq, device=dev)[None]  # [B, mq]
    kpos = torch.arange(mk, device=dev)
    mask = (kpos[None, None] <= qpos[:, :, None]) & (kpos[None, None] < sl_t[:, None, None])
    if sliding_window is not None: mask &= kpos[None, None] > qpos[:, :, None] - sliding_window
    mask |= ~mask.any(-1, keepdim=True)  # padded query rows: attend anywhere, result is dropped
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.float(), k.float(), v.float(), attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)[bidx, rows].to(q.dtype)
