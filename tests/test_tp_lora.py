"""LoRA layers under tensor parallelism across real processes: 2 gloo ranks on the loopback (torch.multiprocessing spawn).

Each rank builds the column-parallel qkv (KV heads split, and one KV head replicated on both ranks) and gate_up,
and the row-parallel o and down, loads its shards of the full weights, wraps them in `LoRALinear` and loads two
full adapters (different ranks, different slices); a batch of tokens of slot 0, slot 1 and no adapter is compared,
in fp32, with the same layers and adapters at tensor-parallel size 1: a column-parallel rank's output equals its
columns of the full output (each slice's `shard_range`), a row-parallel output (its partial LoRA term added before the
one all-reduce) equals the whole output (1e-5); the adapters move the outputs. A quantized base is refused under TP.
Then through the engine: `LLM(tensor_parallel_size=2, enable_lora=True)` (the adapter sent to the workers in the
request's first step message) against tensor parallel 1.
"""

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cvllm_lab.layers.lora import LoRALinear, LoRAMapping, apply_lora
from cvllm_lab.utils import parallel_state as ps

H, D, HEADS, I, T, R = 32, 8, 4, 48, 7, 4
SLOTS = [0, 1, -1, 0, 1, 1, -1]


def _layers(kv: int, tp: int, rank: int):
    "qkv, gate_up (column-parallel), o, down (row-parallel) at `tp`, each with its full weights' shard loaded."
    g = torch.Generator().manual_seed(kv)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2
    W = dict(q=rnd(HEADS * D, H), k=rnd(kv * D, H), v=rnd(kv * D, H), o=rnd(H, HEADS * D), g=rnd(I, H), u=rnd(I, H))
    W['d'] = rnd(H, I)
    qkv = QKVParallelLinear(H, D, HEADS, kv, tp_rank=rank, tp_size=tp)
    gu = MergedColumnParallelLinear(H, [I, I], shard_ids=[0, 1], tp_rank=rank, tp_size=tp)
    o = RowParallelLinear(HEADS * D, H, tp_rank=rank, tp_size=tp)
    down = RowParallelLinear(I, H, tp_rank=rank, tp_size=tp)
    for s in 'qkv':
        qkv.weight_loader(qkv.weight, W[s], s)
    gu.weight_loader(gu.weight, W['g'], 0)
    gu.weight_loader(gu.weight, W['u'], 1)
    o.weight_loader(o.weight, W['o'])
    down.weight_loader(down.weight, W['d'])
    return dict(qkv=qkv, gate_up=gu, o=o, down=down)


def _adapters(kv: int):
    "Two full adapters per layer: slice -> (A [r, in], B [out, r]), rank 4 on everything / rank 2 on some slices."
    g = torch.Generator().manual_seed(100 + kv)
    rnd = lambda *s: torch.randn(*s, generator=g)
    outs = dict(qkv=[HEADS * D, kv * D, kv * D], gate_up=[I, I], o=[H], down=[H])
    ins = dict(qkv=H, gate_up=H, o=HEADS * D, down=I)
    ad0 = {n: {s: (rnd(4, ins[n]), rnd(o, 4)) for s, o in enumerate(outs[n])} for n in outs}
    ad1 = {n: {s: (rnd(2, ins[n]), rnd(o, 2)) for s, o in enumerate(outs[n]) if s != 1} for n in outs}
    return ad0, ad1


def _wrapped(kv: int, tp: int, rank: int):
    m = LoRAMapping(16, 2)
    lay = {n: LoRALinear(b, m, max_rank=R) for n, b in _layers(kv, tp, rank).items()}
    ad0, ad1 = _adapters(kv)
    for n, l in lay.items():
        l.set_slot(0, ad0[n], scaling=0.5)
        l.set_slot(1, ad1[n], scaling=2.0)
    m.set(SLOTS)
    return lay


def check(rank: int, n: int):
    g = torch.Generator().manual_seed(7)
    x, xo, xd = torch.randn(T, H, generator=g), torch.randn(T, HEADS * D, generator=g), torch.randn(T, I, generator=g)
    for kv in (2, 1):  # KV heads split over the 2 ranks / one KV head replicated on both
        tp, one = _wrapped(kv, n, rank), _wrapped(kv, 1, 0)
        for name in ('qkv', 'gate_up'):
            got, full, lyr = tp[name](x), one[name](x), tp[name].base
            cols = torch.cat([full.split(one[name].slices, -1)[s].narrow(-1, *lyr.shard_range(sid))
                              for s, sid in enumerate(lyr.shard_ids)], -1)  # fmt: skip
            torch.testing.assert_close(got, cols, atol=1e-5, rtol=1e-5)
            assert (got - lyr(x))[[0, 1, 3, 4]].abs().amax(1).min() > 1e-2  # the adapters move the rows they cover
            torch.testing.assert_close(got[[2, 6]], lyr(x)[[2, 6]], atol=0, rtol=0)
        for name, xin in (('o', xo), ('down', xd)):
            local = xin.narrow(-1, *tp[name].base.shard_range())
            got, full = tp[name](local), one[name](xin)
            torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
            assert (got - tp[name].base(local))[[0, 1, 3]].abs().amax(1).min() > 1e-2
    from torch import nn

    from cvllm_lab.quant.w4a16 import W4A16Linear

    net = nn.Module()
    net.o_proj = W4A16Linear.from_linear(_layers(2, 1, 0)['o'])  # a quantized layer in a TP>1 process
    with pytest.raises(NotImplementedError, match='tensor parallelism over quantized'):
        apply_lora(net, ['o_proj'], 1, 8, 8)


def _rank_main(rank, n, port):
    torch.set_num_threads(1)
    ps.init_distributed(ps.DistInit(rank, n, rank, '127.0.0.1', port), 'cpu', timeout_s=60)
    try:
        check(rank, n)
    finally:
        ps.destroy_distributed()


def test_tp_lora_matches_tp1():
    mp.spawn(_rank_main, args=(2, ps.free_port()), nprocs=2, join=True)


def _engine_run(root, tp: int) -> list:
    "Greedy tokens and prompt log-probs of base and adapter requests in one batch through `LLM` at tensor parallel `tp`."
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.engine.lora_manager import LoRARequest

    llm = LLM(str(root / 'base'), dtype='float32', progress=False, skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=8, max_loras=2, tensor_parallel_size=tp, device='cpu', block_size=4,
              max_num_batched_tokens=16, max_model_len=64, kv_cache_memory=4 << 20)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 9, 6)]
    reqs = [None, LoRARequest('a', 1, str(root / 'a')), LoRARequest('a', 1, str(root / 'a')), None]
    prompts[2] = prompts[0]
    sp = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=-1, ignore_eos=True)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids, torch.tensor([[d[t].logprob for t in range(128)] for d in o.prompt_logprobs[1:]]))
            for o in outs]  # fmt: skip


def test_tp2_engine_with_lora_matches_tp1(tmp_path):
    """A tiny Llama and a PEFT adapter on every projection through the engine at tensor parallel 2 (gloo workers, the
    adapter sent with the request's first step message and read by each worker) equals tensor parallel 1: greedy
    tokens and prompt log-probs within 1e-4; the adapter changes the prompt's log-probs."""
    peft = pytest.importorskip('peft')
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                      architectures=['LlamaForCausalLM'])  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / 'base')
    torch.manual_seed(1)
    targets = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
    m = peft.get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / 'base'),
                            peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))  # fmt: skip
    with torch.no_grad():
        for n, p in m.named_parameters():
            if 'lora_B' in n:
                p.normal_(0, 0.3)
    m.save_pretrained(tmp_path / 'a')
    one, two = _engine_run(tmp_path, 1), _engine_run(tmp_path, 2)
    for (t1, l1), (t2, l2) in zip(one, two):
        assert t1 == t2
        torch.testing.assert_close(l2, l1, atol=1e-4, rtol=0)
    assert (one[2][1] - one[0][1]).abs().max() > 0.05  # same prompt, with and without the adapter
