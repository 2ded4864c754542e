"""Tune the M = 1 W4A16 GEMV (`w4a16_gemv`) on a GPU and write its launch configs as data.

    python -m benchmarks.kernels.tune_w4a16_gemv --mode grid|nh|maxnreg|slot|sym [--out DIR] [--write]
        [--shapes qkv,o,gate_up,down] [--groups 128,32] [--limit N] [--workers N] [--dry]

For every shape (the Llama-3-8B matmuls by default) and weight format (`--groups`: 128 = W4A16 g128 symmetric, the
`shapes` table; 32 = the asymmetric group-32 layout of the GGUF q4_0/q4_1/q4_k/q8_0 repacks, `small_group_shapes`),
the mode generates candidate configs around the current one:

- `grid`: block N x K-tiles per iteration x column tiles (`nh`) x register prefetch x split-K (programs per SM)
- `nh`: the same grid with two column tiles per program (`nh=2`) only
- `maxnreg`: register caps per thread on the current config
- `slot`: row halves (`rs`) x K-tiles per iteration x register caps (groups >= 64)
- `sym`: `slot` with the symmetric path on (`sym=True`: offsets not read) and split-K variants (g128 only)

Each candidate is installed in the loaded tables, so `w4a16_gemv` launches exactly what the JSON entry would, then
checked against the fp32 reference (x in bf16, output in fp32) and timed over rotating weight copies in a CUDA graph
(`common.time_fn`), gate_up with the fused activation as the model runs it. All candidates are compiled first by
parallel worker processes. Written to `--out` (default `.`): `tune_w4a16_gemv_<mode>.csv` (every timing) and
`<device>.json`, the device's tables with each shape's best candidate where it beats the current config (`--write`:
into `kernels/configs/w4a16_gemv/` directly). `--dry` runs one small shape and a few candidates on the CPU under the
Triton interpreter (a check of the script, not a measurement).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import copy
import csv
import itertools
import json
import os
import sys

import torch
import triton

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels.split_k import pick_split
from cvllm_lab.kernels.w4a16 import w4a16_gemv

KERNEL = 'w4a16_gemv'
MODES = ('grid', 'nh', 'maxnreg', 'slot', 'sym')
FORMATS = {128: ('shapes', True), 32: ('small_group_shapes', False)}  # group -> (table, symmetric weights)
# register caps per shape (`maxnreg`); other shapes take CAPS_OTHER
CAPS = {
    'qkv': (None, 144, 152, 160, 168, 176, 192),
    'o': (None, 56, 60, 64, 68, 72, 80),
    'gate_up': (None, 80, 88, 96, 104, 112, 128),
    'down': (None, 80, 88, 96, 104, 112),
}
CAPS_OTHER = (None, 64, 72, 80, 96, 128)


def _tpi(tpi, nh, tiles):
    "K-tiles per iteration as the launcher clamps them."
    tpi = min(tpi, 4 if nh == 1 else 2)
    while tiles % tpi:
        tpi //= 2
    return tpi


def _split(tiles, progs, tpi, target):
    return pick_split(tiles, triton.cdiv(int(target * C.num_sms()), progs), tpi)


def candidates(mode, name, N, K, group, cur):
    "Configs (dicts in the JSON format, `split` resolved) to time against the current config `cur`."
    tiles = -(-K // 128)
    out = []
    if mode in ('grid', 'nh'):
        for bn, tpi, nh, pf, target in itertools.product((64, 128), (1, 2, 4), (1, 2), (False, True), (4, 7, 10)):
            if (mode == 'nh' and nh == 1) or (nh == 2 and tpi > 2):
                continue
            t = _tpi(tpi, nh, tiles)
            out.append(
                dict(bn=bn, tpi=t, num_warps=4, num_stages=1, split=_split(tiles, -(-N // bn), t, target), pf=pf, nh=nh)
            )
    elif mode == 'maxnreg':
        for reg in CAPS.get(name, CAPS_OTHER):
            c = {k: v for k, v in cur.items() if k != 'maxnreg'}
            out.append(dict(c, maxnreg=reg) if reg else c)
    elif mode in ('slot', 'sym'):
        if group < 64:
            return []
        splits = [None] if mode == 'slot' else [None] + sorted({_split(tiles, -(-N // 128), 1, tg) for tg in (4, 7)})
        for rs, tpi, reg, split in itertools.product((False, True), (1, 2), (None, 72, 80, 88, 96), splits):
            if rs and tpi != 1:
                continue
            c = {k: v for k, v in cur.items() if k not in ('maxnreg', 'rs')}
            c.update(bn=128, nh=2, tpi=tpi)
            if split:
                c['split'] = split
            if tpi == 1 and not rs:
                c['rs'] = False  # row halves are on by default where they apply
            if reg:
                c['maxnreg'] = reg
            out.append(c)
    uniq = []
    for c in out:
        if c not in uniq and c != cur:
            uniq.append(c)
    return uniq


def _install(table, key, cfg):
    "Make `cfg` the config that `w4a16_gemv` reads for `key` (None: remove the entry)."
    T = tuned.configs_for(KERNEL, C.DEVICE)
    if cfg is None:
        T[table].pop(key, None)
    else:
        T[table][key] = cfg


def _run(x, p, group, N, K, act, sym, out_dtype=None):
    return w4a16_gemv(x, *p, 4, group, N, K, act=act, sym=sym, out_dtype=out_dtype)


def _compile_worker(jobs):
    "Run each (group, name, N, K, cfg) once: compiles it into Triton's disk cache."
    bad = 0
    for group, name, N, K, cfg in jobs:
        table, sym = FORMATS[group]
        try:
            _install(table, (N, K, 4), cfg)
            p = C.packed_w4a16(N, K, group, sym)[:3]
            x = torch.randn(1, K, device=C.DEVICE, dtype=C.XDT)
            _run(x, p, group, N, K, 'silu_and_mul' if name == 'gate_up' else None, sym)
        except Exception as e:
            bad += 1
            print('compile failed', name, group, cfg, repr(e)[:300], flush=True)
    return bad


def main():
    mode = C.arg('--mode', None)
    if mode not in MODES:
        sys.exit(f'--mode must be one of {MODES}')
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    names = C.arg('--shapes', 'o' if C.DRY else ','.join(C.L3_8B)).split(',')
    groups = [int(g) for g in C.arg('--groups', '128' if C.DRY else '128,32').split(',')]
    limit = int(C.arg('--limit', 3 if C.DRY else 0)) or None
    dev_key = 'default' if C.DRY else tuned.device_key(C.device_name())
    print(C.device_name(), torch.__version__, 'triton', triton.__version__, 'mode', mode, flush=True)
    torch.manual_seed(0)
    T = tuned.configs_for(KERNEL, C.DEVICE)
    before = copy.deepcopy(T)
    plan = []  # (group, name, N, K, current config, candidates)
    for group in groups:
        table, sym = FORMATS[group]
        for name in names:
            N, K = C.L3_8B[name]
            cur = T[table].get((N, K, 4), T['default' if group >= 64 else 'small_group'])
            if mode == 'sym' and not sym:
                continue
            cands = candidates(mode, name, N, K, group, cur)[:limit]
            if cands:
                plan.append((group, name, N, K, cur, cands))
    jobs = [(g, n, N, K, c) for g, n, N, K, cur, cs in plan for c in [cur] + cs]
    if not C.DRY:
        C.precompile(_compile_worker, jobs, int(C.arg('--workers', min(12, (os.cpu_count() or 2) - 1))))
    rows, best = [], {}
    for group, name, N, K, cur, cands in plan:
        table, sym = FORMATS[group]
        p, x, r, nb, args, act = C.gemv_case(name, N, K, group, sym)
        use_sym = sym and mode == 'sym'
        for kind, cfg in [('current', cur)] + [('candidate', c) for c in cands]:
            _install(table, (N, K, 4), cfg)
            try:
                err = C.rel_err(_run(x, p, group, N, K, None, use_sym, torch.float32), r)
                if not err < 1e-3:
                    print('WRONG', name, group, cfg, err, flush=True)
                    continue
                us = C.time_fn(args, lambda x_, q, s, o: _run(x_, (q, s, o), group, N, K, act, use_sym), nb)
            except Exception as e:
                print('failed', name, group, cfg, repr(e)[:300], flush=True)
                continue
            rows.append(
                dict(
                    gpu=C.device_name(),
                    mode=mode,
                    group=group,
                    shape=name,
                    N=N,
                    K=K,
                    kind=kind,
                    sym=use_sym,
                    cfg=json.dumps(cfg),
                    us=round(us, 2),
                    rel_err=f'{err:.2e}',
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            k = (table, (N, K, 4))
            if kind == 'current':
                best[k] = dict(us=us, cfg=cur, cur_us=us)
            elif k in best and us < best[k]['us']:
                best[k].update(us=us, cfg=cfg)
        _install(table, (N, K, 4), before[table].get((N, K, 4)))
    if rows:
        with open(os.path.join(out_dir, f'tune_{KERNEL}_{mode}.csv'), 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    tables = copy.deepcopy(before)
    for (table, key), b in best.items():
        print(f'{table} {key}: current {b["cur_us"]:.2f} us, best {b["us"]:.2f} us {json.dumps(b["cfg"])}', flush=True)
        if b['us'] < b['cur_us']:
            tables[table][key] = b['cfg']
    if '--write' in sys.argv and C.DRY:
        sys.exit('--write is for GPU runs (a dry run would overwrite default.json)')
    path = os.path.join(tuned.CONFIG_DIR / KERNEL if '--write' in sys.argv else out_dir, f'{dev_key}.json')
    with open(path, 'w') as f:
        f.write(tuned.dump_configs(tables))
    print('wrote', path, flush=True)
    if mode == 'sym' and rows:
        print('note: `sym` winners assume symmetric layers (GPTQ sym, RTN); the table serves asymmetric ones too')


if __name__ == '__main__':
    main()
