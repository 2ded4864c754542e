"""Pooling models on a GPU (issue 46): an encoder (BERT: bidirectional attention through the Triton flash kernel with
`causal=False`, packed sequences of mixed lengths in one step) and a decoder converted to embeddings (Qwen3 with
last-token pooling, through the paged KV path), each against `transformers` on the same device. Skipped without CUDA.

Token-id prompts on tiny random configs saved by `transformers` (no tokenizer needed: `skip_tokenizer_init`)."""

import tempfile

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V = 1000
LENS = (7, 1, 300, 64, 129, 2, 511, 33)  # mixed, one at the whole context (512 positions)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope='module')
def bert_dir():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=V,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=512,
    )
    with tempfile.TemporaryDirectory() as d:
        m = BertModel(cfg).eval()
        m.save_pretrained(d)
        yield d, m


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_bert_cls_embeddings_match_transformers(bert_dir, dtype):
    "CLS pooling (bare BERT's default), normalized: cosine per sequence >= 0.9999 (fp32) / 0.995 (bf16)."
    from cvllm_lab import LLM

    d, hf = bert_dir
    llm = LLM(d, runner='pooling', dtype=dtype, skip_tokenizer_init=True, progress=False)
    try:
        prompts = _prompts()
        outs = llm.embed([{'prompt_token_ids': p} for p in prompts], use_tqdm=False)
        hf = hf.to('cuda', torch.float32)
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf(torch.tensor([p], device='cuda')).last_hidden_state[0, 0]
            got = torch.tensor(o.outputs.embedding, device='cuda', dtype=torch.float32)
            cos = F.cosine_similarity(got, F.normalize(ref, dim=-1), dim=0).item()
            assert cos >= (0.9999 if dtype == 'float32' else 0.995), (len(p), cos)
            assert abs(got.norm().item() - 1) < 1e-3  # normalized
    finally:
        del llm
        torch.cuda.empty_cache()


def test_decoder_last_token_embeddings_match_transformers():
    "A Qwen3 decoder with `convert='embed'`: the last token's final hidden state, normalized, vs transformers' (bf16)."
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cvllm_lab import LLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    cfg.architectures = ['Qwen3ForCausalLM']
    with tempfile.TemporaryDirectory() as d:
        hf = Qwen3ForCausalLM(cfg).eval()
        hf.save_pretrained(d)
        llm = LLM(d, runner='pooling', convert='embed', dtype='bfloat16', skip_tokenizer_init=True, progress=False)
        try:
            prompts = _prompts()
            outs = llm.embed([{'prompt_token_ids': p} for p in prompts], use_tqdm=False)
        finally:
            del llm
            torch.cuda.empty_cache()
    hf = hf.to('cuda', torch.float32)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.model(torch.tensor([p], device='cuda')).last_hidden_state[0, -1]
        got = torch.tensor(o.outputs.embedding, device='cuda', dtype=torch.float32)
        cos = F.cosine_similarity(got, F.normalize(ref, dim=-1), dim=0).item()
        assert cos >= 0.995, (len(p), cos)


def _modernbert_case(dtype: str, device: str = 'cuda'):
    """A tiny random ModernBERT (4 layers: global, local, local, global; local_attention 64, so the 300- and 511-token
    prompts are longer than a window) through `LLM(runner='pooling')` against transformers on `device`: normalized CLS
    embeddings, and a mean-pooled 3-label classifier's probabilities. fp32 runs the padded SDPA path with the band
    mask, bf16 on a GPU the flash kernel with window_size (W-1, W-1)."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    from cvllm_lab import LLM

    kw = dict(
        vocab_size=V,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
        local_attention=64,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    prompts, bound = _prompts(), 0.9999 if dtype == 'float32' else 0.995
    for cls, task in ((ModernBertModel, 'embed'), (ModernBertForSequenceClassification, 'classify')):
        torch.manual_seed(0)
        hf = cls(ModernBertConfig(num_labels=3, classifier_pooling='mean', **kw)).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            llm = LLM(d, dtype=dtype, device=device, skip_tokenizer_init=True, progress=False)
            try:
                outs = getattr(llm, task)([{'prompt_token_ids': p} for p in prompts], use_tqdm=False)
            finally:
                del llm
                if device == 'cuda':
                    torch.cuda.empty_cache()
        hf = hf.to(device, torch.float32)
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                out = hf(torch.tensor([p], device=device))
            if task == 'embed':
                ref = F.normalize(out.last_hidden_state[0, 0], dim=-1)
                got = torch.tensor(o.outputs.embedding, device=device)
                assert F.cosine_similarity(got, ref, dim=0).item() >= bound, (len(p), dtype)
            else:
                ref, got = out.logits[0].softmax(-1), torch.tensor(o.outputs.probs, device=device)
                assert (got - ref).abs().max().item() < (1e-4 if dtype == 'float32' else 2e-2), (len(p), dtype)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_modernbert_matches_transformers(dtype):
    "ModernBERT's local and global layers on the GPU (fp32: padded path; bf16: FlashAttention-2's symmetric window)."
    _modernbert_case(dtype)
