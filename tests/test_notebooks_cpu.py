"""`Run All` on a CPU-only machine, as a new user does it: a notebook that uses Triton kernels and has a cell flagged
`#| cuda` executes top to bottom through Jupyter (`jupyter nbconvert --execute`) with no GPU visible and no
`TRITON_INTERPRET` set by hand. The kernels switch to the interpreter by themselves (`cvllm_lab.kernels`), and the
flagged cell prints why it is skipped (`cvllm_lab`'s IPython hook)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ['23_sampler.ipynb']  # Triton sampling kernels and a `#| cuda` cell; a minute on 2 cores

pytest.importorskip('nbconvert')


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_run_all_on_cpu(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env.update(CUDA_VISIBLE_DEVICES='', PYTHONPATH=str(ROOT))
    out = tmp_path / name
    r = subprocess.run(
        [
            sys.executable,
            '-m',
            'jupyter',
            'nbconvert',
            '--to',
            'notebook',
            '--execute',
            '--ExecutePreprocessor.timeout=600',
            '--ExecutePreprocessor.kernel_name=python3',
            '--output',
            str(out),
            str(ROOT / 'nbs' / name),
        ],
        cwd=ROOT / 'nbs',
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cells = json.loads(out.read_text())['cells']
    flagged = [c for c in cells if c['cell_type'] == 'code' and ''.join(c['source']).lstrip().startswith('#| cuda')]
    assert flagged
    for c in flagged:
        text = ''.join(''.join(o.get('text', '')) for o in c.get('outputs', []))
        assert 'skipped: this cell is flagged #| cuda' in text, text
