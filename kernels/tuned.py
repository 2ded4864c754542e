"""Tuned launch configurations, kept as data: `configs/<kernel>/<device>.json`, one file per kernel and GPU model.

`<device>` is `torch.cuda.get_device_name()` with spaces as underscores (`NVIDIA_H200`). `default.json` serves every
device without a file of its own (and CPU runs under the Triton interpreter); a device file replaces the tables it
names and takes the others from `default.json`.

A file is a JSON object of named *tables*. A table is either one launch config (`{"bn": 64, "num_warps": 4}`) or a
map from a key to a config, where the key is a comma-separated list of integers, such as the shape `"6144,4096,4"`
(N, K, bits) or the row bucket `"16"`. `load_configs` turns those keys into int tuples (`(6144, 4096, 4)`) or ints
(`16`), so a launcher looks a shape up as `tables['shapes'].get((N, K, bits), tables['default'])`. The tables each
kernel reads, and what their fields mean, are described in `configs/README.md`. The returned tables are shared:
callers must not modify them.
"""

import functools
import json
import re
from pathlib import Path

import torch

__all__ = ['CONFIG_DIR', 'device_key', 'load_configs', 'configs_for', 'dump_configs']
CONFIG_DIR = Path(__file__).resolve().parent / 'configs'
_INT_KEY = re.compile(r'^-?\d+(,-?\d+)*$')


def _key(k: str):
    if not _INT_KEY.match(k):
        return k
    v = tuple(int(p) for p in k.split(','))
    return v[0] if len(v) == 1 else v


def _parse(obj):
    "JSON -> tables: integer-list keys as int tuples (one integer: an int), recursively."
    if isinstance(obj, dict):
        return {_key(k): _parse(v) for k, v in obj.items()}
    return obj


def device_key(name: str) -> str:
    "The config file name of a GPU model: `torch.cuda.get_device_name()` with spaces as underscores."
    return name.strip().replace(' ', '_')


@functools.lru_cache(None)
def load_configs(kernel: str, device: str = 'default') -> dict:
    "The tables of `kernel` for `device` (a `device_key`, or 'default'): `default.json`, updated by `<device>.json`."
    tables = _parse(json.loads((CONFIG_DIR / kernel / 'default.json').read_text()))
    path = CONFIG_DIR / kernel / f'{device}.json'
    if device != 'default' and path.exists():
        tables.update(_parse(json.loads(path.read_text())))
    return tables


@functools.lru_cache(None)
def _device_name(device: torch.device) -> str:
    if device.type != 'cuda':
        return 'default'
    return device_key(torch.cuda.get_device_name(device))


def configs_for(kernel: str, device: torch.device) -> dict:
    "The tables of `kernel` for the GPU model of the torch `device` (`default.json` off CUDA)."
    return load_configs(kernel, _device_name(device))


def _jkey(k) -> str:
    return ','.join(map(str, k)) if isinstance(k, tuple) else str(k)


def dump_configs(tables: dict) -> str:
    """Tables (as `load_configs` returns them) as the JSON text of a config file, one config per line (the inverse
    of `load_configs`; tuners write their results with it)."""
    out = []
    for name, t in tables.items():
        if isinstance(t, dict) and t and all(isinstance(v, dict) for v in t.values()):
            inner = ',\n'.join(f'    {json.dumps(_jkey(k))}: {json.dumps(v)}' for k, v in t.items())
            out.append(f'  {json.dumps(name)}: {{\n{inner}\n  }}')
        else:
            out.append(f'  {json.dumps(name)}: {json.dumps(t)}')
    return '{\n' + ',\n'.join(out) + '\n}\n'
