"""Videos on a GPU (issue 44): the tiny random Qwen2.5-VL of `test_server_vision` in fp32 through `LLM` on CUDA with a
video alone and an image with a video (chunked prefill splitting the runs, prefix caching on), against transformers
on the same GPU given the same patches (`patch_video`) and `second_per_grid_ts`: prompt log-probs within 1e-3, and
the 12 greedy tokens are the argmax of transformers' forward over prompt and answer at its own positions (as in
notebook 31b). Skipped without CUDA; `check(tmp, 'cpu')` runs the same body on the CPU."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
IMG, VID, START, END = 250, 251, 248, 249


def check(d, device):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration
    from test_server_vision import tiny_qwen2_5_vl
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.utils.multimodal import patch_video

    tiny_qwen2_5_vl(d)
    if device == 'cuda':  # transformers' patch embedding is a Conv3d, which cuDNN runs in TF32 by default (~1e-3 off)
        torch.backends.cudnn.allow_tf32 = False
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).to(device).eval()
    ip = AutoImageProcessor.from_pretrained(d)
    rng = np.random.default_rng(0)
    clip, clip2 = (rng.integers(0, 256, s, dtype=np.uint8) for s in ((4, 20, 28, 3), (3, 36, 16, 3)))
    a = Image.fromarray(rng.integers(0, 256, (20, 28, 3), dtype=np.uint8))
    prompts = [
        {'prompt_token_ids': [1, 5, START, VID, END, 7, 8], 'multi_modal_data': {'video': (clip, {'fps': 1.0})}},
        {
            'prompt_token_ids': [1, START, IMG, END, 5, START, VID, END, 9],
            'multi_modal_data': {'image': a, 'video': clip2},
        },
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
        kv_cache_memory=64 << 20,
    )
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    errs = []
    for pr, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        mmd = pr['multi_modal_data']
        frames, meta = mmd['video'] if isinstance(mmd['video'], tuple) else (mmd['video'], {})
        pv, grid = patch_video(ip, frames)
        ids = torch.tensor([o.prompt_token_ids], device=device)
        kw = dict(
            input_ids=ids,
            pixel_values_videos=pv.to(device),
            video_grid_thw=torch.tensor([grid], device=device),
            second_per_grid_ts=torch.tensor([2 / meta.get('fps', 2.0)], device=device),
            mm_token_type_ids=(ids == IMG).int() + 2 * (ids == VID).int(),
        )
        if 'image' in mmd:
            im = ip(images=[mmd['image']], return_tensors='pt')
            kw |= dict(pixel_values=im['pixel_values'].to(device), image_grid_thw=im['image_grid_thw'].to(device))
        L, ans = ids.shape[1], o.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(**kw).logits[0].float(), -1).cpu()
            rope = {k: kw[k] for k in kw if k in ('input_ids', 'mm_token_type_ids', 'video_grid_thw', 'image_grid_thw')}
            pos, rd = hf.model.get_rope_index(**rope, second_per_grid_ts=kw['second_per_grid_ts'])
            pos = torch.cat([pos, (torch.arange(L, L + 12, device=device) + rd).expand(3, 1, -1)], -1)
            full = kw | dict(input_ids=torch.cat([ids, torch.tensor([ans], device=device)], 1), position_ids=pos)
            full['mm_token_type_ids'] = torch.cat([kw['mm_token_type_ids'], torch.zeros_like(ids[:, :12])], 1)
            forced = hf(**full).logits[0, L - 1 : -1].argmax(-1).tolist()
        got = torch.tensor([[d_[t].logprob for t in range(256)] for d_ in o.prompt_logprobs[1:]])
        errs.append((got - ref[:-1]).abs().max().item())
        assert errs[-1] < 1e-3, errs
        assert forced == ans
    return errs


def test_qwen2_5_vl_video_cuda_matches_transformers(tmp_path):
    check(tmp_path, 'cuda')
