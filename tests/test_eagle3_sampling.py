"""EAGLE-3 (notebook 51f) keeps sampling lossless when the head's `q` is zero off its draft vocabulary: `n` seeded
samples of one prompt at temperature 1 with top-k 40, `max_tokens = 3` (room for one draft); the second token comes from the first decode
step, which verifies one EAGLE-3 draft drawn from `q`. Its distribution must be the target's marginal
`sum_t1 p(t1) p(t2 | t1)` (transformers' model, the same filters): a chi-square test over the bins with at least 5
expected draws, seeded so it cannot flake. The head drafts the target's own prediction at its row restricted to 96 of
the 128 ids (`lm_head` = the target's rows `sel`, `d2t = sel - arange`), so `q` is close to `p` where it is not zero
and most drafts are accepted; the same run with a wrong `q` handed to the rejection sampler (uniform) must fail."""

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.layers.rejection_sampler import process_logits

V, H, L, I, D, VD = 128, 48, 7, 96, 12, 96
N, PROMPT = 2000, [1, 5, 17, 33, 8]


def _models() -> tuple[str, str, LlamaForCausalLM]:
    "A random Llama whose last layer adds nothing, and a head drafting its prediction over 96 of its ids."
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd['lm_head.weight'] = 3 * sd['lm_head.weight'] + 2 * sd['model.embed_tokens.weight']
    for n in ('self_attn.o_proj', 'mlp.down_proj'):
        sd[f'model.layers.{L - 1}.{n}.weight'].zero_()
    m.load_state_dict(sd)
    target = tempfile.mkdtemp()
    m.save_pretrained(target)
    g = torch.Generator().manual_seed(1)
    sel = torch.randperm(V, generator=g)[:VD].sort().values
    rn = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5
    W = {
        'fc.weight': torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1),
        'midlayer.input_layernorm.weight': torch.ones(H),
        'midlayer.hidden_norm.weight': torch.ones(H),
        'midlayer.self_attn.q_proj.weight': rn(4 * D, 2 * H),
        'midlayer.self_attn.k_proj.weight': rn(2 * D, 2 * H),
        'midlayer.self_attn.v_proj.weight': rn(2 * D, 2 * H),
        'midlayer.self_attn.o_proj.weight': torch.zeros(H, 4 * D),
        'midlayer.post_attention_layernorm.weight': torch.ones(H),
        'midlayer.mlp.gate_proj.weight': rn(I, H),
        'midlayer.mlp.up_proj.weight': rn(I, H),
        'midlayer.mlp.down_proj.weight': torch.zeros(H, I),
        'norm.weight': sd['model.norm.weight'],
        'lm_head.weight': sd['lm_head.weight'][sel],
        'd2t': sel - torch.arange(VD),
        't2d': torch.zeros(V, dtype=torch.bool).index_fill_(0, sel, True),
    }
    head = Path(tempfile.mkdtemp())
    c = dict(
        architectures=['LlamaForCausalLMEagle3'],
        model_type='llama',
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=2048,
        vocab_size=V,
        draft_vocab_size=VD,
        eagle_aux_hidden_state_layer_ids=[2, 3, L - 1],
    )
    (head / 'config.json').write_text(json.dumps(c))
    save_file({k: v.contiguous() for k, v in W.items()}, str(head / 'model.safetensors'), metadata={'format': 'pt'})
    return target, str(head), m


def test_eagle3_sampling_follows_the_target():
    target, head, hf = _models()
    sp = SamplingParams(n=N, seed=7, max_tokens=3, temperature=1.0, top_k=40, ignore_eos=True)
    with torch.no_grad():
        p1 = process_logits(hf(torch.tensor([PROMPT])).logits[0, -1:], [sp], [1]).softmax(-1)[0]
        lg2 = hf(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1]
        p2 = process_logits(lg2, [sp] * V, [1] * V).softmax(-1)
    expected = (p1[:, None] * p2).sum(0).double().numpy() * N

    def pvalue(seconds: list[int]) -> float:
        got, big = np.bincount(seconds, minlength=V).astype(float), expected >= 5
        c, e = np.append(got[big], got[~big].sum()), np.append(expected[big], expected[~big].sum())
        e[-1] = N - e[:-1].sum()
        return chisquare(c, e).pvalue

    llm = LLM(
        target,
        progress=False,
        skip_tokenizer_init=True,
        device='cpu',
        block_size=4,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        max_model_len=32,
        kv_cache_memory=8 << 20,
        cpu_fast_path=False,
        speculative_config=dict(method='eagle3', model=head, num_speculative_tokens=1),
    )
    second = lambda: [
        c.token_ids[1] for c in llm.generate([{'prompt_token_ids': PROMPT}], sp, use_tqdm=False)[0].outputs
    ]
    ok = pvalue(second())
    st = llm.engine.core.stats()
    assert st['spec_decode_num_drafts'] == N
    assert N // 4 < st['spec_decode_num_accepted_tokens'] < N  # q near p: most drafts accepted, not all
    proposer = llm.engine.core.runner.draft
    step = proposer.step

    def wrong_q(so, b):  # a lossy rule: the rejection sampler told the drafts were uniform
        q = step(so, b)
        return None if q is None else torch.full_like(q, 1 / V)

    proposer.step = wrong_q
    lossy = pvalue(second())
    print(
        f'{st["spec_decode_num_accepted_tokens"]} of {N} drafts accepted; chi-square p = {ok:.3f}; with a wrong q p = {lossy:.1e}'
    )
    assert ok > 0.01 and lossy < 1e-6
