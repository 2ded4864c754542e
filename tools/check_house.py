#!/usr/bin/env python
"""The house rules CI checks, beyond the tests: `python tools/check_house.py` (exit 1 with what is wrong).

1. Floors and loops of the library's imports (`check_imports.py`).
2. No source file in `cvllm_lab/`, `kernels/`, `benchmarks/` or `tools/` longer than `MAX_LINES` (a file over it
   holds more than one job; nbdev's symbol index `_modidx.py` is exempt).
3. No measurement diary in code or notebook sources: no hashes of this repository's commits (the history of what
   each change measured lives in `results/NOTES.md`). Candidates are 7-40 character hex words with a digit and a
   letter (not `0x` literals, not nbdev's `# %%` cell markers); those git knows as commits are reported.
4. No module reaches into another module's private names (`obj._name`; `check_private.py`, with its allowlist).
5. `ruff format --check` and `ruff check` pass (settings in `pyproject.toml`: the notebooks are formatted, the
   generated library is linted).
"""

from __future__ import annotations
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_imports
import check_private

ROOT = check_imports.ROOT
MAX_LINES = 500  # after `ruff format`: a file over it is split by job
SIZE_DIRS = ('cvllm_lab', 'kernels', 'benchmarks', 'tools')
HASH = re.compile(r'(?<![\w-])(?!0x)[0-9a-f]{7,40}(?![\w-])')


def _hashes(text: str) -> list[str]:
    text = '\n'.join(l for l in text.splitlines() if not l.startswith('# %%'))
    return [m for m in HASH.findall(text) if re.search(r'\d', m) and re.search(r'[a-f]', m)]


def commits(words: set[str]) -> set[str]:
    "The words that name a commit of this repository."
    if not words:
        return set()
    ws = sorted(words)
    out = subprocess.run(
        ['git', 'cat-file', '--batch-check'],
        input=''.join(f'{w}^{{commit}}\n' for w in ws),
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.splitlines()
    return {w for w, line in zip(ws, out) if not line.endswith('missing') and 'ambiguous' not in line}


def notebook_sources(path: Path) -> str:
    return '\n'.join(''.join(c['source']) for c in json.loads(path.read_text())['cells'])


def sizes() -> list[str]:
    out = []
    for d in SIZE_DIRS:
        for f in sorted((ROOT / d).rglob('*.py')):
            n = len(f.read_text().splitlines())
            if n > MAX_LINES and f.name != '_modidx.py':
                out.append(f'{f.relative_to(ROOT)}: {n} lines (at most {MAX_LINES}: split it by job)')
    return out


def ruff() -> list[str]:
    "`ruff format --check` and `ruff check` on the repository: their complaints, one per line."
    out = []
    for args in (['format', '--check'], ['check', '--output-format', 'concise']):
        r = subprocess.run([sys.executable, '-m', 'ruff', *args, '.'], capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            out += [f'ruff {args[0]}: {l}' for l in r.stdout.splitlines() if l.strip()]
    return out


def diaries() -> list[str]:
    out = []
    files = [
        f
        for d in ('cvllm_lab', 'kernels', 'benchmarks')
        for f in sorted((ROOT / d).rglob('*.py'))
        if f.name != '_modidx.py'
    ]
    for f in files + sorted((ROOT / 'nbs').glob('*.ipynb')):
        text = notebook_sources(f) if f.suffix == '.ipynb' else f.read_text()
        if found := commits(set(_hashes(text))):
            out.append(
                f'{f.relative_to(ROOT)}: commit hashes {", ".join(sorted(found)[:5])} '
                '(measurement history goes to results/NOTES.md)'
            )
    return out


if __name__ == '__main__':
    assert _hashes('at 5af620f and 0x3F800000, deadbeef, 1234567, a58b782c-ffff\n# %% x.ipynb #be5991c4') == ['5af620f']
    problems = check_imports.check() + sizes() + diaries() + check_private.check(verbose=False) + ruff()
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(
        f'house: {len(check_imports.modules())} modules on their floors, no loops, no file over {MAX_LINES} '
        'lines, no commit hashes in sources, no reach-ins to private names outside the allowlist, ruff clean'
    )
