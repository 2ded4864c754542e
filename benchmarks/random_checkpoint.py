"""A random-weight checkpoint at a named shape, in the Hugging Face layout, that vLLM, `transformers` and our engine all
load as a real model (issue 50: the same weights on both sides of a MoE comparison).

    python -m benchmarks.random_checkpoint MODEL [--out DIR] [--layers N] [--device cuda] [--seed 0]
        [--shard-gb 4] [--hf-config JSON]

MODEL names `conf/model/<MODEL>.yaml`; its `hf_config` (with `--hf-config`'s fields merged over it, `--layers` as
`num_hidden_layers`) becomes `config.json`, beside a word-level tokenizer over the whole vocabulary (serve_load's, so
every id decodes to text) and `model.safetensors.index.json` + `model-0000k-of-0000n.safetensors` shards of about
`--shard-gb` GB.

The tensor names and shapes are not written by hand: the model is built by `transformers` at the config on the meta
device and its `state_dict()` is taken, mapped back to the checkpoint's own names where transformers 5 fuses them on
load (`revert_weight_conversion`: per-expert `experts.{e}.gate_proj.weight` and the like, as the Hub checkpoints of
DeepseekV2ForCausalLM and Qwen3MoeForCausalLM have them), so any architecture transformers knows comes out right.
The values follow transformers' `_init_weights`: normal(0, `initializer_range`) for matrices (embeddings, projections,
routers: router logits spread as a trained model's, not near-tied as with vLLM's uniform +-1e-3 dummy weights), ones
for norm weights and other vectors, zeros for biases; bf16. Each tensor is drawn on `--device` from its own seed
(the run's seed and its name), so the first N layers are the same whatever `--layers` says, and written shard by
shard: host memory holds one shard at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import zlib
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def hf_config(model: str, layers: int | None = None, override: dict | None = None) -> dict:
    "`conf/model/<model>.yaml`'s `hf_config`, `override` merged over it, `layers` decoder layers, bf16."
    cfg = dict(yaml.safe_load((ROOT / 'conf/model' / f'{model}.yaml').read_text())['hf_config'])
    cfg |= override or {}
    if layers:
        cfg['num_hidden_layers'] = layers
    if 'initializer_range' not in cfg:
        cfg['initializer_range'] = transformers_config(cfg).initializer_range
    return cfg | {'torch_dtype': 'bfloat16', 'dtype': 'bfloat16'}


def transformers_config(cfg: dict):
    from transformers import AutoConfig

    kw = {k: v for k, v in cfg.items() if k not in ('model_type', 'architectures', 'torch_dtype', 'dtype')}
    return AutoConfig.for_model(cfg['model_type'], **kw)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', name)]


def init_kind(name: str, shape: tuple) -> str:
    "What transformers' `_init_weights` gives a tensor: `zeros` (biases), `ones` (norm weights, other vectors), `normal`."
    if name.endswith('bias'):
        return 'zeros'
    return 'ones' if len(shape) == 1 else 'normal'


def tensor_specs(cfg: dict) -> list[tuple[str, tuple, str]]:
    """`(name, shape, init kind)` of every tensor of the checkpoint, in natural name order: transformers' model at
    `cfg` built on the meta device, its state dict mapped back to the checkpoint's names (transformers >= 5)."""
    from transformers import AutoModelForCausalLM

    tc = transformers_config(cfg)
    with torch.device('meta'):
        model = AutoModelForCausalLM.from_config(tc)
    sd = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the modules hold the checkpoint's names already
        revert_weight_conversion = None
    if revert_weight_conversion is not None:
        sd = revert_weight_conversion(model, sd)
    if getattr(tc, 'tie_word_embeddings', False):
        sd.pop('lm_head.weight', None)  # tied to the embedding: not in the checkpoint
    return [(k, tuple(sd[k].shape), init_kind(k, tuple(sd[k].shape))) for k in sorted(sd, key=_natural)]


def plan_shards(specs: list, shard_bytes: int) -> list[list]:
    "Consecutive specs grouped into shards of at most `shard_bytes` (bf16) each (a larger tensor gets its own)."
    shards, cur, size = [], [], 0
    for s in specs:
        n = 2 * int(torch.Size(s[1]).numel())
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    return shards + ([cur] if cur else [])


def make_tensor(name: str, shape: tuple, kind: str, std: float, seed: int, device: str) -> torch.Tensor:
    if kind == 'zeros':
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    if kind == 'ones':
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed * 0x9E3779B1 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=g)


def write_tokenizer(cfg: dict, out: Path):
    "serve_load's word-level tokenizer over the whole vocabulary (`t0` ... `t{V-1}`), which both engines load."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f't{i}': i for i in range(cfg['vocab_size'])}, unk_token='t0'))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.WhitespaceSplit(), decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token='t0', eos_token='t1', bos_token='t2').save_pretrained(out)


def write_checkpoint(
    cfg: dict, out: Path, device: str = 'cpu', seed: int = 0, shard_gb: float = 4.0, log=print
) -> list[tuple[str, tuple, str]]:
    "Write `cfg`'s random checkpoint into `out` (config, tokenizer, sharded safetensors); returns the tensor specs."
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(cfg, out)  # before config.json: save_pretrained writes nothing of the model's
    (out / 'config.json').write_text(json.dumps(cfg, indent=1))
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, int(shard_gb * 1e9))
    n, std, total = len(shards), cfg['initializer_range'], 0
    names = [f'model-{k + 1:05d}-of-{n:05d}.safetensors' for k in range(n)]
    weight_map, t0 = {}, time.perf_counter()
    log(f'{len(specs)} tensors, {sum(2 * torch.Size(s[1]).numel() for s in specs) / 1e9:.2f} GB in {n} shards -> {out}')
    for k, (shard, fname) in enumerate(zip(shards, names)):
        t = time.perf_counter()
        tensors = {nm: make_tensor(nm, shape, kind, std, seed, device).cpu() for nm, shape, kind in shard}
        gen = time.perf_counter() - t
        save_file(tensors, str(out / fname), metadata={'format': 'pt'})
        size = sum(v.numel() * 2 for v in tensors.values())
        total += size
        weight_map |= {nm: fname for nm in tensors}
        del tensors
        dt = time.perf_counter() - t
        log(
            f'shard {k + 1}/{n}: {size / 1e9:.2f} GB in {dt:.1f} s ({size / 1e9 / dt:.2f} GB/s; generating {gen:.1f} s), '
            f'{total / 1e9:.1f} GB written in {time.perf_counter() - t0:.0f} s',
        )
    index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
    (out / 'model.safetensors.index.json').write_text(json.dumps(index, indent=1))
    return specs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model', help='conf/model/<model>.yaml')
    ap.add_argument('--out', default=None, help='default /tmp/ckpt_<model>')
    ap.add_argument('--layers', type=int, default=None, help='only the first N decoder layers')
    ap.add_argument('--device', default='cpu', help='where the tensors are drawn (cuda: fast)')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--shard-gb', type=float, default=4.0)
    ap.add_argument('--hf-config', default=None, help='JSON of config fields merged over the yaml (tiny test shapes)')
    a = ap.parse_args(argv)
    cfg = hf_config(a.model, a.layers, json.loads(a.hf_config) if a.hf_config else None)
    out = Path(a.out or f'/tmp/ckpt_{a.model}')
    t = time.perf_counter()
    write_checkpoint(cfg, out, a.device, a.seed, a.shard_gb, log=lambda s: print(s, flush=True))
    print(f'{a.model} ({cfg["num_hidden_layers"]} layers) written to {out} in {time.perf_counter() - t:.0f} s')


if __name__ == '__main__':
    main()
