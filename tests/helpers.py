"""Helpers shared by several test modules (`tests/` is on `sys.path` under pytest: `from helpers import ...`)."""

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rel_err(a, b) -> float:
    "`||a - b|| / ||b||` in fp32."
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_model_dir(model: str, shrink: dict | None = None) -> Path:
    "A folder with `conf/model/<model>.yaml`'s config.json (as `bench.sweep.model_dir` writes it), `shrink` applied."
    import yaml
    from transformers import AutoConfig

    hf = dict(yaml.safe_load((ROOT / 'conf/model' / f'{model}.yaml').read_text())['hf_config'])
    hf.update(shrink or {})
    d = Path(tempfile.mkdtemp())
    AutoConfig.for_model(hf.pop('model_type'), **hf).save_pretrained(d)
    return d


def tiny_tokenizer(vocab_size: int):
    "A word-level tokenizer over `vocab_size` ids (`<unk>`, `w1`, `w2`, ...), built offline: no model download."
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({'<unk>': 0, **{f'w{i}': i for i in range(1, vocab_size)}}, unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>')


def tiny_qwen3_moe(hidden: int = 128, head_dim: int = 32):
    """A random Qwen3-MoE (2 layers, 16 experts top-4, vocab 256) in fp32 with its norms and router spread off their
    init values (so routing and scale matter), saved to a folder: `(cfg, hf_model, folder)`."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        moe_intermediate_size=hidden,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        architectures=['Qwen3MoeForCausalLM'],
    )
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n:
                p.normal_(0, 0.5)
            elif 'gate.weight' in n:
                p.normal_(0, 0.3)
    d = Path(tempfile.mkdtemp())
    hf.save_pretrained(d)
    return cfg, hf, d
