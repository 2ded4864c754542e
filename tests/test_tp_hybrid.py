"""A hybrid model (Qwen3-Next: Gated DeltaNet layers beside gated attention, experts) at tensor parallel 2 through the
engine (CPU, gloo): the same answers as one process.

Each rank holds half of the GDN key and value heads (and their conv channels, decay and write gates, and the states
in its slots), half of the attention heads and of the experts' width; the state slots go to the workers in every
step message. A tiny random model saved with `save_pretrained` runs through `LLM` at tensor parallel 1 and 2 on the
paged, chunked, batched path (prompts longer than a prefill chunk, batched with decode steps): greedy tokens equal
and every prompt log-prob within 1e-4 (fp32).
"""

import tempfile
from pathlib import Path

import torch

VOCAB, LENS, MAX_TOKENS = 250, (5, 23, 41, 12), 6
ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, kv_cache_memory=8 << 20, device='cpu')


def make_model(root: Path) -> Path:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from cvllm_lab.config import default_model_path
    from cvllm_lab.tokenizer import load_tokenizer

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        eos_token_id=None,
        bos_token_id=None,
        architectures=['Qwen3NextForCausalLM'],
    )
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n or n.endswith(('A_log', 'dt_bias')):
                p.normal_(0, 0.5)
            elif 'gate.weight' in n:
                p.normal_(0, 0.3)
    hf.save_pretrained(root)
    gg = default_model_path()
    load_tokenizer(gg.parent, gg.name).save_pretrained(root)
    return root


def run(model: str, tp: int) -> dict:
    from cvllm_lab import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENS]
    llm = LLM(model, progress=False, tensor_parallel_size=tp, **ENGINE)
    try:
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=-1, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.engine.shutdown()
    return {
        'tokens': [o.outputs[0].token_ids for o in outs],
        'plp': [torch.tensor([[d[t].logprob for t in range(VOCAB)] for d in o.prompt_logprobs[1:]]) for o in outs],
    }


def test_qwen3_next_tp2_matches_tp1():
    d = make_model(Path(tempfile.mkdtemp()))
    one, two = run(str(d), 1), run(str(d), 2)
    assert two['tokens'] == one['tokens']
    for a, b in zip(two['plp'], one['plp']):
        assert (a - b).abs().max() < 1e-4, (a - b).abs().max()
