"""The tuned launch configurations (`cvllm_lab.kernels.tuned`, `kernels/configs/<kernel>/<device>.json`)."""

import json

import torch

from cvllm_lab.kernels import tuned


def test_every_kernel_has_a_default_and_parses():
    kernels = sorted(p.name for p in tuned.CONFIG_DIR.iterdir() if p.is_dir())
    assert {'w4a16_gemv', 'w4a16_mm', 'w4a16_tc', 'w4a16_mma', 'fp8_gemv', 'fp8_mm', 'gguf_gemv'} <= set(kernels)
    for k in kernels:
        for f in (tuned.CONFIG_DIR / k).glob('*.json'):
            json.loads(f.read_text())  # every file is valid JSON
        assert 'default' in tuned.load_configs(k)


def test_keys_and_device_fallback():
    t = tuned.load_configs('w4a16_gemv')
    assert t['shapes'][(6144, 4096, 4)]['nh'] == 2  # "N,K,bits" -> an int tuple
    assert set(tuned.load_configs('w4a16_mm')['default']) == {16, 32, 64, 128}  # row buckets -> ints
    assert tuned.device_key(' NVIDIA H100 80GB HBM3 ') == 'NVIDIA_H100_80GB_HBM3'
    assert tuned.load_configs('w4a16_gemv', 'NO_SUCH_GPU') == t  # a device without a file: default.json
    assert tuned.configs_for('w4a16_gemv', torch.device('cpu')) == t
    # the H200 file holds today's tables, and default.json the same (other GPUs run the H200's choices)
    for k in ('w4a16_gemv', 'w4a16_mm', 'w4a16_tc', 'w4a16_mma', 'fp8_gemv', 'fp8_mm', 'gguf_gemv'):
        assert tuned.load_configs(k, 'NVIDIA_H200') == tuned.load_configs(k), k


def test_device_file_replaces_the_tables_it_names(tmp_path, monkeypatch):
    d = tmp_path / 'demo'
    d.mkdir()
    (d / 'default.json').write_text('{"default": {"bn": 16}, "shapes": {"1,2": {"bn": 8}}}')
    (d / 'GPU_X.json').write_text('{"shapes": {"3,4": {"bn": 32}}}')
    monkeypatch.setattr(tuned, 'CONFIG_DIR', tmp_path)
    tuned.load_configs.cache_clear()
    try:
        assert tuned.load_configs('demo', 'GPU_X') == {'default': {'bn': 16}, 'shapes': {(3, 4): {'bn': 32}}}
        assert tuned.load_configs('demo') == {'default': {'bn': 16}, 'shapes': {(1, 2): {'bn': 8}}}
    finally:
        tuned.load_configs.cache_clear()


def test_dump_configs_is_the_inverse_of_load():
    "Tuners write their tables with `dump_configs`: the shipped files are in exactly that format."
    for d in tuned.CONFIG_DIR.iterdir():
        if not d.is_dir():
            continue
        for f in d.glob('*.json'):
            assert tuned.dump_configs(tuned._parse(json.loads(f.read_text()))) == f.read_text(), f
