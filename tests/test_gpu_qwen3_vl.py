"""Qwen3-VL on a GPU (issue 44): a tiny random fp32 Qwen3-VL (DeepStack after tower blocks 0 and 2, interleaved
M-RoPE, a 4 x 4 learned position table) through `LLM` on CUDA (Triton attention with M-RoPE applied before it,
async scheduling, no CUDA graphs for this model), chunked prefill splitting image runs, prefix caching on: prompt
log-probs within 1e-3 of transformers on the same GPU and 12 greedy tokens equal, for prompts with one and two
images. Skipped without CUDA; `check(tmp, 'cpu')` runs the same body on the CPU."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
IMG, START, END = 250, 248, 249


def tiny_qwen3_vl(d):
    "A tiny random Qwen3-VL checkpoint and its image processor (4-pixel patches, merge 2) saved in `d`."
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = dict(rope_type='default', rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True)
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.1, rope_parameters=rope),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 2], initializer_range=0.1),
        image_token_id=IMG, video_token_id=251, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.5)
            elif 'norm' in n:
                p.normal_(1, 0.1)
    hf.save_pretrained(d)
    Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=1024
    ).save_pretrained(d)


def check(d, device):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration
    from cvllm_lab import LLM, SamplingParams

    tiny_qwen3_vl(d)
    if device == 'cuda':  # transformers' patch embedding is a Conv3d, which cuDNN runs in TF32 by default (~1e-3 off)
        torch.backends.cudnn.allow_tf32 = False
    hf = Qwen3VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).to(device).eval()
    ip = AutoImageProcessor.from_pretrained(d)
    rng = np.random.default_rng(0)
    pic = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    a, b = pic(20, 28), pic(36, 16)
    text = [1, 5, 6, START, IMG, END, 7, 8, 9]
    prompts = [
        {'prompt_token_ids': text, 'multi_modal_data': {'image': a}},
        {'prompt_token_ids': text, 'multi_modal_data': {'image': b}},
        {'prompt_token_ids': [1, 2, START, IMG, END, 4, START, IMG, END, 9], 'multi_modal_data': {'image': [b, a]}},
    ]
    llm = LLM(
        str(d),
        skip_tokenizer_init=True,
        progress=False,
        dtype='float32',
        device=device,
        block_size=16,
        prefill_chunk_size=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        limit_mm_per_prompt={'image': 2},
        kv_cache_memory=64 << 20,
    )
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    errs = []
    for pr, o in zip(prompts, outs):
        ims = pr['multi_modal_data']['image']
        pv = ip(images=ims if isinstance(ims, list) else [ims], return_tensors='pt')
        ids = torch.tensor([o.prompt_token_ids], device=device)
        kw = dict(
            input_ids=ids,
            pixel_values=pv['pixel_values'].to(device),
            image_grid_thw=pv['image_grid_thw'].to(device),
            mm_token_type_ids=(ids == IMG).int(),
        )
        with torch.no_grad():
            ref = torch.log_softmax(hf(**kw).logits[0].float(), -1).cpu()
            gen = hf.generate(**kw, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1] :]
        got = torch.tensor([[d_[t].logprob for t in range(256)] for d_ in o.prompt_logprobs[1:]])
        errs.append((got - ref[:-1]).abs().max().item())
        assert errs[-1] < 1e-3, errs
        assert o.outputs[0].token_ids == gen.tolist()
    return errs


def test_qwen3_vl_cuda_matches_transformers(tmp_path):
    check(tmp_path, 'cuda')
