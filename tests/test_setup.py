"""Set-up as a new user meets it: `scripts/setup.sh` is idempotent and offline once done, `scripts/serve.sh --help`
works without a package index, and building the package prints no setuptools warning and ships its data files."""

import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PY = ROOT / '.venv' / 'bin' / 'python'
pytestmark = pytest.mark.skipif(
    not VENV_PY.exists() or not (ROOT / '.venv' / '.cvllm-lab-setup').exists(),
    reason='needs a finished scripts/setup.sh (.venv and its stamp)',
)

# no package index, no proxy that answers: any pip or network use fails
OFFLINE = {
    **os.environ,
    'PIP_NO_INDEX': '1',
    'PIP_FIND_LINKS': '',
    'PIP_INDEX_URL': 'http://127.0.0.1:9/simple',
    'http_proxy': 'http://127.0.0.1:9',
    'https_proxy': 'http://127.0.0.1:9',
    'HF_HUB_OFFLINE': '1',
}


@pytest.mark.timing
def test_setup_is_idempotent_and_offline():
    t = time.perf_counter()
    r = subprocess.run(['scripts/setup.sh'], cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    assert r.stdout == '' and r.stderr == '', (r.stdout, r.stderr)  # nothing installed, nothing said
    assert took < 5, took


def test_serve_help_offline():
    r = subprocess.run(
        ['scripts/serve.sh', '--help'], cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert '--port' in r.stdout and '--max-num-seqs' in r.stdout


def test_build_is_clean(tmp_path):
    "A wheel of the package: no setuptools warning, and the web page and the kernels' tuned configs inside."
    r = subprocess.run(
        [str(VENV_PY), '-m', 'pip', 'wheel', '.', '--no-deps', '--no-build-isolation', '-w', str(tmp_path)],
        cwd=ROOT,
        env=OFFLINE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert 'Warning' not in out and 'absent from the `packages`' not in out, out
    names = zipfile.ZipFile(next(tmp_path.glob('*.whl'))).namelist()
    assert 'cvllm_lab/entrypoints/openai/static/index.html' in names
    n_json = len(list((ROOT / 'kernels' / 'configs').glob('*/*.json')))
    assert sum(n.startswith('cvllm_lab/kernels/configs/') and n.endswith('.json') for n in names) == n_json > 0


def test_top_level_kernels_name_from_the_root():
    """From the repository's root (on sys.path under `python -m`), `import kernels` is the installed Hugging Face
    package where there is one (transformers imports it), not this repo's `kernels/`; ours stays `cvllm_lab.kernels`."""
    code = (
        'import importlib.util as u, importlib.metadata as m, transformers, kernels, cvllm_lab.kernels as ours\n'
        'from transformers import LlamaConfig\n'
        "try: hf = m.distribution('kernels').locate_file('kernels/__init__.py')\n"
        'except m.PackageNotFoundError: hf = None\n'
        "print(kernels.__file__, ours.__file__, hf, sep='|')"
    )
    r = subprocess.run([str(VENV_PY), '-c', code], cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    top, ours, hf = r.stdout.strip().split('|')
    assert Path(ours) == ROOT / 'kernels' / '__init__.py'
    assert Path(top) == (Path(hf) if hf != 'None' else ROOT / 'kernels' / '__init__.py'), (top, hf)
