"""Gemma 3 vision on a GPU (issue 44): a tiny random fp32 Gemma3ForConditionalGeneration (SigLIP tower, 56-pixel
images in 7-pixel patches pooled to 16 tokens, sliding window 6) through `LLM` on CUDA (Triton paged attention, then
the image runs re-attended both ways over the KV cache, `ImageBidirectionalAttention`), 12-token chunks that the
scheduler cuts before image runs, prefix caching on: prompt log-probs within 1e-3 of transformers on the same GPU and
12 greedy tokens equal, for prompts with one and two images, and a prompt whose prefix-cache hit ends inside an
image's run. Skipped without CUDA; `check(tmp, 'cpu')` runs the same body on the CPU."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
IMG, BOI, EOI, N = 299, 297, 298, 16
NL = {10: 1, 11: 2, 12: 3, 13: 4}  # the tokenizer's newline tokens: id -> newlines


def tiny_gemma3_vl(d):
    "A tiny random Gemma 3 vision checkpoint, its image processor and a word-level tokenizer saved in `d`."
    from tokenizers import Tokenizer, models as tm, pre_tokenizers as tp
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil
    from transformers import PreTrainedTokenizerFast

    cfg = Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=6, layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
                         max_position_embeddings=512, initializer_range=0.1),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=7, vision_use_head=False),
        mm_tokens_per_image=N, image_token_id=IMG, boi_token_index=BOI, eoi_token_index=EOI,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.5)
            elif 'norm' in n:
                p.normal_(0, 0.3)
            elif 'mm_input_projection' in n:
                p.normal_(0, 0.3)
    hf.save_pretrained(d)
    Gemma3ImageProcessorPil(size={'height': 56, 'width': 56}).save_pretrained(d)
    special = {0: '<pad>', 1: '<eos>', 2: '<bos>', 3: '<unk>'} | {t: '\n' * n for t, n in NL.items()}
    special |= {BOI: '<start_of_image>', EOI: '<end_of_image>', IMG: '<image_soft_token>'}
    tk = Tokenizer(tm.WordLevel({special.get(i, f'w{i}'): i for i in range(300)}, unk_token='<unk>'))
    tk.pre_tokenizer = tp.WhitespaceSplit()
    toks = dict(bos_token='<bos>', eos_token='<eos>', unk_token='<unk>', pad_token='<pad>')
    PreTrainedTokenizerFast(tokenizer_object=tk, **toks).save_pretrained(d)


def expand(ids):
    "`Gemma3Processor`'s ids: `\\n\\n`, start, N soft tokens, end, `\\n\\n` per image; a newline run is one token."
    out = []
    for t in ids:
        for x in [11, BOI] + [IMG] * N + [EOI, 11] if t == BOI else [t]:
            out[-1:] = [9 + NL[out[-1]] + NL[x]] if out and x in NL and out[-1] in NL else out[-1:] + [x]
    return out


def check(d, device):
    from PIL import Image
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration
    from cvllm_lab import LLM, SamplingParams

    tiny_gemma3_vl(d)
    if device == 'cuda':  # transformers' patch embedding is a Conv2d, which cuDNN may run in TF32
        torch.backends.cudnn.allow_tf32 = False
    hf = Gemma3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).to(device).eval()
    ip = AutoImageProcessor.from_pretrained(d)
    rng = np.random.default_rng(0)
    pic = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    a, b = pic(60, 40), pic(30, 70)
    text = [2, 5, 6, BOI, 7, 8, 9]
    prompts = [
        {'prompt_token_ids': text, 'multi_modal_data': {'image': a}},
        {'prompt_token_ids': text, 'multi_modal_data': {'image': b}},
        {'prompt_token_ids': [2, 4, 10, BOI, 7, BOI, 9], 'multi_modal_data': {'image': [b, a]}},
    ]
    llm = LLM(
        str(d),
        progress=False,
        dtype='float32',
        device=device,
        block_size=16,
        prefill_chunk_size=N + 2,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        limit_mm_per_prompt={'image': 2},
        kv_cache_memory=64 << 20,
    )
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    # the first prompt cut after its image: a prefix-cache hit of 16 tokens, inside the run [5, 21)
    q = {'prompt_token_ids': text[:4], 'multi_modal_data': {'image': a}}
    qo = llm.generate([q], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert qo.num_cached_tokens == 16, qo.num_cached_tokens
    errs = []
    for pr, o in zip(prompts + [q], outs + [qo]):
        ims = pr['multi_modal_data']['image']
        ids = torch.tensor([expand(pr['prompt_token_ids'])], device=device)
        assert o.prompt_token_ids == ids[0].tolist()
        pv = ip(images=ims if isinstance(ims, list) else [ims], return_tensors='pt')['pixel_values']
        kw = dict(input_ids=ids, pixel_values=pv.to(device), token_type_ids=(ids == IMG).long())
        with torch.no_grad():
            ref = torch.log_softmax(hf(**kw).logits[0].float(), -1).cpu()
            gen = hf.generate(**kw, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1] :]
        if o.prompt_logprobs is not None:
            got = torch.tensor([[d_[t].logprob for t in range(300)] for d_ in o.prompt_logprobs[1:]])
            errs.append((got - ref[:-1]).abs().max().item())
            assert errs[-1] < 1e-3, errs
        assert o.outputs[0].token_ids == gen.tolist()
    return errs


def test_gemma3_vl_cuda_matches_transformers(tmp_path):
    check(tmp_path, 'cuda')
