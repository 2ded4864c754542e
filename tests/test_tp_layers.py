"""Tensor-parallel layers across real processes: 2 and 4 gloo ranks on the loopback (torch.multiprocessing spawn).

Each rank loads its shards from the FULL checkpoint tensors (lazy safetensors slices, as the phase-2 loader will)
and every result is compared, in fp32, with the unsharded computation over the same full tensors:
- the collectives (all-reduce, all-gather, gather, broadcast_object);
- each parallel layer (column, merged column, QKV with KV heads split and replicated, row with bias, vocab
  embedding with padding, LM head gathered to rank 0 and to all);
- a tiny 2-layer Llama-shaped model (GQA attention with RoPE in plain PyTorch, SwiGLU MLP, RMSNorm) whose
  logits must match the single-process model within 1e-5.
"""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from cvllm_lab.layers.basic import RMSNorm, SiluAndMul
from cvllm_lab.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from cvllm_lab.utils import parallel_state as ps

# hidden 16, 8 q heads of 4, 2 KV heads (split at TP 2, replicated twice at TP 4), vocab 50 (padded per rank)
CFG = dict(hidden=16, heads=8, kv_heads=2, head_dim=4, inter=24, vocab=50, layers=2, eps=1e-6, theta=10000.0)
PACKED = {
    'q_proj': ('qkv_proj', 'q'),
    'k_proj': ('qkv_proj', 'k'),
    'v_proj': ('qkv_proj', 'v'),
    'gate_proj': ('gate_up_proj', 0),
    'up_proj': ('gate_up_proj', 1),
}
LENS = (5, 3)  # two sequences in one flat batch


def full_weights(seed=0) -> dict[str, torch.Tensor]:
    "HF-named tensors of the tiny model (and of the single-layer checks)."
    g = torch.Generator().manual_seed(seed)
    c, r = CFG, lambda *s: torch.randn(*s, generator=g) * 0.3
    h, D = c['hidden'], c['head_dim']
    w = {
        'model.embed_tokens.weight': r(c['vocab'], h),
        'model.norm.weight': 1 + r(h),
        'lm_head.weight': r(c['vocab'], h),
    }
    for i in range(c['layers']):
        p = f'model.layers.{i}.'
        w |= {
            p + 'input_layernorm.weight': 1 + r(h),
            p + 'post_attention_layernorm.weight': 1 + r(h),
            p + 'self_attn.q_proj.weight': r(c['heads'] * D, h),
            p + 'self_attn.k_proj.weight': r(c['kv_heads'] * D, h),
            p + 'self_attn.v_proj.weight': r(c['kv_heads'] * D, h),
            p + 'self_attn.o_proj.weight': r(h, c['heads'] * D),
            p + 'mlp.gate_proj.weight': r(c['inter'], h),
            p + 'mlp.up_proj.weight': r(c['inter'], h),
            p + 'mlp.down_proj.weight': r(h, c['inter']),
        }
    w |= {
        't.col.weight': r(12, h),
        't.col.bias': r(12),
        't.row.weight': r(h, 24),
        't.row.bias': r(h),
        't.q.bias': r(c['heads'] * D),
        't.k.bias': r(c['kv_heads'] * D),
        't.v.bias': r(c['kv_heads'] * D),
        't.x': r(7, h),
        't.xr': r(7, 24),
    }
    return w


# ---- the model, in plain PyTorch over our layers ----


def rope(x, pos, theta):
    "Neox-style rotary embedding of `x [T, n, D]` at positions `pos [T]`."
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f.cos()] * 2, -1)[:, None], torch.cat([f.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(q, k, v, lens, D):
    "Causal GQA attention per sequence of a flat batch: `q [T, H, D]`, `k, v [T, Hkv, D]`."
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, s = [], 0
    for n in lens:
        qs, ks, vs = q[s : s + n].transpose(0, 1), k[s : s + n].transpose(0, 1), v[s : s + n].transpose(0, 1)
        a = (qs @ ks.transpose(1, 2)) / math.sqrt(D)
        a = a.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float('-inf')).softmax(-1)
        out.append((a @ vs).transpose(0, 1))
        s += n
    return torch.cat(out).flatten(1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = (
            RMSNorm(c['hidden'], c['eps']),
            RMSNorm(c['hidden'], c['eps']),
        )
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(c['hidden'], c['head_dim'], c['heads'], c['kv_heads'])
        self.self_attn.o_proj = RowParallelLinear(c['heads'] * c['head_dim'], c['hidden'])
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(c['hidden'], [c['inter']] * 2)
        self.mlp.down_proj = RowParallelLinear(c['inter'], c['hidden'])
        self.c = c

    def forward(self, h, pos, lens):
        c, qkv = self.c, self.self_attn.qkv_proj
        x = self.input_layernorm(h)
        q, k, v = qkv(x).split(qkv.output_sizes, -1)
        T, D = h.shape[0], c['head_dim']
        q, k = rope(q.view(T, -1, D), pos, c['theta']), rope(k.view(T, -1, D), pos, c['theta'])
        h = h + self.self_attn.o_proj(attention(q, k, v.view(T, -1, D), lens, D))  # all-reduce #1
        return h + self.mlp.down_proj(SiluAndMul()(self.mlp.gate_up_proj(self.post_attention_layernorm(h))))  # #2


class TinyTP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(c['vocab'], c['hidden'], padding_size=8)
        self.model.layers = nn.ModuleList(Block(c) for _ in range(c['layers']))
        self.model.norm = RMSNorm(c['hidden'], c['eps'])
        self.lm_head = ParallelLMHead(c['vocab'], c['hidden'], padding_size=8)

    def forward(self, ids, pos, lens):
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, pos, lens)
        return self.model.norm(h)

    def load_weights(self, get):
        "Phase 2's loading loop in miniature: route HF names, hand each layer the full (lazy) tensor."
        params = dict(self.named_parameters())
        for name in get.names:
            if name.startswith('t.'):
                continue
            shard, dst = None, name
            for src, (to, sid) in PACKED.items():
                if f'.{src}.' in name:
                    dst, shard = name.replace(f'.{src}.', f'.{to}.'), sid
                    break
            owner = self.get_submodule(dst.rsplit('.', 1)[0])
            loader = getattr(owner, 'weight_loader', None)
            if loader is not None:
                loader(params[dst], get.slice(name), shard)
            else:
                params[dst].data.copy_(get.tensor(name))


def reference_logits(w, ids, pos, lens):
    "The same model on one process, from the full tensors."
    c, D = CFG, CFG['head_dim']
    norm = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c['eps']) * g
    h, T = w['model.embed_tokens.weight'][ids], len(ids)
    for i in range(c['layers']):
        p = f'model.layers.{i}.'
        x = norm(h, w[p + 'input_layernorm.weight'])
        q = rope((x @ w[p + 'self_attn.q_proj.weight'].T).view(T, -1, D), pos, c['theta'])
        k = rope((x @ w[p + 'self_attn.k_proj.weight'].T).view(T, -1, D), pos, c['theta'])
        v = (x @ w[p + 'self_attn.v_proj.weight'].T).view(T, -1, D)
        h = h + attention(q, k, v, lens, D) @ w[p + 'self_attn.o_proj.weight'].T
        x = norm(h, w[p + 'post_attention_layernorm.weight'])
        h = (
            h
            + (F.silu(x @ w[p + 'mlp.gate_proj.weight'].T) * (x @ w[p + 'mlp.up_proj.weight'].T))
            @ w[p + 'mlp.down_proj.weight'].T
        )
    return norm(h, w['model.norm.weight']) @ w['lm_head.weight'].T


class Checkpoint:
    "The safetensors file: lazy slices (what the sharded loaders read) and whole tensors (the reference), on `device`."

    def __init__(self, fh, device='cpu'):
        self.fh, self.names, self.device = fh, list(fh.keys()), device

    def slice(self, name):
        return self.fh.get_slice(name)

    def tensor(self, name):
        return self.fh.get_tensor(name).to(self.device)


# ---- what each rank checks ----

ATOL = 1e-5  # fp32; the CUDA run (NCCL) allows 1e-4 for its different matmul order


def close(a, b, **kw):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def check_collectives(rank, n):
    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(ps.tensor_model_parallel_all_reduce(x.clone()), torch.full((2, 3), n * (n + 1) / 2))
    g = ps.tensor_model_parallel_all_gather(torch.tensor([[rank, 10 + rank]]), dim=-1)
    assert g.tolist() == [[v for r in range(n) for v in (r, 10 + r)]]
    got = ps.tensor_model_parallel_gather(torch.tensor([rank]), dst=0, dim=0)
    assert (got.tolist() == list(range(n))) if rank == 0 else got is None
    assert ps.broadcast_object({'step': 7} if rank == 0 else None) == {'step': 7}
    assert ps.tensor_model_parallel_min(100 - rank) == 101 - n


def check_layers(rank, n, ck):
    t = ck.tensor
    x, xr = t('t.x'), t('t.xr')
    col = ColumnParallelLinear(16, 12, bias=True, gather_output=True)
    col.weight_loader(col.weight, ck.slice('t.col.weight'))
    col.weight_loader(col.bias, ck.slice('t.col.bias'))
    assert col.weight.shape == (12 // n, 16)
    close(col(x), F.linear(x, t('t.col.weight'), t('t.col.bias')))
    row = RowParallelLinear(24, 16, bias=True)
    row.weight_loader(row.weight, ck.slice('t.row.weight'))
    row.weight_loader(row.bias, ck.slice('t.row.bias'))
    close(row(xr.chunk(n, -1)[rank].contiguous()), F.linear(xr, t('t.row.weight'), t('t.row.bias')))
    p, D = 'model.layers.0.self_attn.', CFG['head_dim']
    qkv = QKVParallelLinear(16, D, CFG['heads'], CFG['kv_heads'], bias=True)
    for s in 'qkv':
        qkv.weight_loader(qkv.weight, ck.slice(f'{p}{s}_proj.weight'), s)
        qkv.weight_loader(qkv.bias, ck.slice(f't.{s}.bias'), s)
    q, k, v = qkv(x).split(qkv.output_sizes, -1)
    full = {s: F.linear(x, t(f'{p}{s}_proj.weight'), t(f't.{s}.bias')).view(7, -1, D) for s in 'qkv'}
    nh, rep = CFG['heads'] // n, max(1, n // CFG['kv_heads'])
    close(q.view(7, -1, D), full['q'][:, rank * nh : (rank + 1) * nh])
    kv = slice(rank // rep * qkv.num_kv_heads, (rank // rep + 1) * qkv.num_kv_heads)
    close(k.view(7, -1, D), full['k'][:, kv])
    close(v.view(7, -1, D), full['v'][:, kv])
    assert qkv.num_kv_head_replicas == rep
    emb = VocabParallelEmbedding(CFG['vocab'], 16, padding_size=8)
    emb.weight_loader(emb.weight, ck.slice('model.embed_tokens.weight'))
    ids = torch.tensor([0, 5, 12, 13, 25, 37, 49, 48])
    assert torch.equal(emb(ids), t('model.embed_tokens.weight')[ids])
    head = ParallelLMHead(CFG['vocab'], 16, padding_size=8)
    head.weight_loader(head.weight, ck.slice('lm_head.weight'))
    ref = x @ t('lm_head.weight').T
    close(head.compute_logits(x, gather_to_all=True), ref)
    got = head.compute_logits(x)
    if rank == 0:
        close(got, ref)
    else:
        assert got is None


def check_model(rank, n, ck):
    torch.manual_seed(1)
    ids = torch.randint(0, CFG['vocab'], (sum(LENS),))
    pos = torch.cat([torch.arange(L) for L in LENS])
    m = TinyTP(CFG)
    m.load_weights(ck)
    assert (
        m.model.layers[0].self_attn.qkv_proj.weight.shape[0]
        == (CFG['heads'] // n + 2 * max(1, CFG['kv_heads'] // n)) * 4
    )
    with torch.inference_mode():
        logits = m.lm_head.compute_logits(m(ids, pos, LENS))
    if rank == 0:
        ref = reference_logits({k: ck.tensor(k) for k in ck.names}, ids, pos, LENS)
        close(logits, ref)
    else:
        assert logits is None


def _rank_main(rank, n, port, path, device='cpu'):
    global ATOL
    torch.set_num_threads(1)
    if device == 'cuda':
        device, ATOL = f'cuda:{rank}', 1e-4
        torch.set_default_device(device)  # every tensor and layer of the checks on this rank's GPU
    ps.init_distributed(ps.DistInit(rank, n, rank, '127.0.0.1', port), device, timeout_s=60)
    try:
        assert (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()) == (rank, n)
        if device != 'cpu':
            assert os.environ['NCCL_NVLS_ENABLE'] == '0' and os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'] == '1'
        with safe_open(path, framework='pt') as fh:
            ck = Checkpoint(fh, device)
            check_collectives(rank, n)
            check_layers(rank, n, ck)
            check_model(rank, n, ck)
    finally:
        ps.destroy_distributed()


@pytest.mark.parametrize('n', [2, 4])
def test_tp_layers_match_unsharded(n, tmp_path):
    path = str(tmp_path / 'tiny.safetensors')
    save_file(full_weights(), path)
    mp.spawn(_rank_main, args=(n, ps.free_port(), path), nprocs=n, join=True)


@pytest.mark.cuda
def test_tp_layers_nccl(tmp_path):
    "The same checks over NCCL, one GPU per rank (2 GPUs, 4 where there are 4)."
    n = 4 if torch.cuda.device_count() >= 4 else 2
    if torch.cuda.device_count() < 2:
        pytest.skip('needs 2 GPUs')
    path = str(tmp_path / 'tiny.safetensors')
    save_file(full_weights(), path)
    mp.spawn(_rank_main, args=(n, ps.free_port(), path, 'cuda'), nprocs=n, join=True)


def test_reference_is_the_model_at_tp1(tmp_path):
    "The same checks in this process with no group: the layers are plain (TP 1) and must match too."
    path = str(tmp_path / 'tiny.safetensors')
    save_file(full_weights(), path)
    with safe_open(path, framework='pt') as fh:
        ck = Checkpoint(fh)
        check_collectives(0, 1)
        check_layers(0, 1, ck)
        check_model(0, 1, ck)
