"""Qwen2.5-VL on a GPU (issue 44): the tiny random checkpoint of `test_server_vision` in fp32 through `LLM` on CUDA
(Triton attention with M-RoPE applied before it, FlashAttention prefill, async scheduling, no CUDA graphs for this
model), chunked prefill splitting image runs, prefix caching on: prompt log-probs within 1e-3 of transformers on the
same GPU and 12 greedy tokens equal. Skipped without CUDA."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


def test_qwen2_5_vl_cuda_matches_transformers(tmp_path, monkeypatch):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration
    from test_server_vision import tiny_qwen2_5_vl
    from cvllm_lab import LLM, SamplingParams

    tiny_qwen2_5_vl(tmp_path)
    # transformers' patch embedding is a Conv3d, which cuDNN runs in TF32 by default (about 1e-3 off fp32)
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    ip = AutoImageProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    pic = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    a, b = pic(20, 28), pic(36, 16)
    text = [1, 5, 6, 248, 250, 249, 7, 8, 9]
    prompts = [
        {'prompt_token_ids': text, 'multi_modal_data': {'image': a}},
        {'prompt_token_ids': text, 'multi_modal_data': {'image': b}},
        {'prompt_token_ids': [1, 2, 248, 250, 249, 4, 248, 250, 249, 9], 'multi_modal_data': {'image': [b, a]}},
    ]
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        progress=False,
        dtype='float32',
        block_size=16,
        prefill_chunk_size=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        limit_mm_per_prompt={'image': 2},
        kv_cache_memory=64 << 20,
    )
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for pr, o in zip(prompts, outs):
        ims = pr['multi_modal_data']['image']
        pv = ip(images=ims if isinstance(ims, list) else [ims], return_tensors='pt')
        ids = torch.tensor([o.prompt_token_ids], device='cuda')
        kw = dict(
            input_ids=ids,
            pixel_values=pv['pixel_values'].cuda(),
            image_grid_thw=pv['image_grid_thw'].cuda(),
            mm_token_type_ids=(ids == 250).int(),
        )
        with torch.no_grad():
            ref = torch.log_softmax(hf(**kw).logits[0].float(), -1).cpu()
            gen = hf.generate(**kw, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1] :]
        got = torch.tensor([[d[t].logprob for t in range(256)] for d in o.prompt_logprobs[1:]])
        assert (got - ref[:-1]).abs().max() < 1e-3
        assert o.outputs[0].token_ids == gen.tolist()
