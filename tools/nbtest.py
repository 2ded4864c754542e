#!/usr/bin/env python
"""The notebooks' tests, one fresh process per notebook: `python tools/nbtest.py [--jobs 2] [--flags F] [NB ...]`.

Each notebook runs as `nbdev-test NB` (the same cells, flags and cell timeout as one `nbdev-test` over them all),
`--jobs` at a time. A process per notebook because `nbdev-test`'s workers keep what every notebook they ran
allocated (the cells' namespaces stay alive): a worker that ran several engine notebooks holds all their models
and KV caches. Prints a line per notebook (time, peak resident memory of its process tree, sampled by `peak_rss`)
with its output when it had any besides `Success.`, then the failures; exit status 1 when one failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_rss import tree_rss

GB = 1e9


def notebooks(file_re: str | None) -> list[Path]:
    "The notebooks `nbdev-test` would test (nbdev's glob over `nbs_path`), minus folders holding a `.notest` file."
    from nbdev.doclinks import nbglob

    fs = nbglob(as_path=True, file_re=file_re)
    return [f for f in sorted(fs) if not any((p / '.notest').exists() for p in f.parents)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('nbs', nargs='*', type=Path, help="notebooks (default: all of nbdev's)")
    ap.add_argument('--jobs', type=int, default=2, help='notebooks at a time')
    ap.add_argument('--flags', default='', help="nbdev-test's --flags: cells so flagged run too")
    ap.add_argument('--file-re', help='only notebooks whose name matches')
    ap.add_argument('--interval', type=float, default=0.5, help='seconds between memory samples')
    a = ap.parse_args()
    todo = [f.absolute() for f in a.nbs] or notebooks(a.file_re)
    if not todo:
        sys.exit('no notebooks to test (run from the repository, or name them)')
    cmd = ['nbdev-test', *(['--flags', a.flags] if a.flags else [])]
    running: dict[Path, tuple[subprocess.Popen, object, float, list[int]]] = {}
    failed, t0, peak = [], time.monotonic(), 0
    while todo or running:
        while todo and len(running) < a.jobs:
            nb = todo.pop(0)
            out = tempfile.TemporaryFile('w+')
            p = subprocess.Popen([*cmd, str(nb)], stdout=out, stderr=subprocess.STDOUT)
            running[nb] = (p, out, time.monotonic(), [0])
        total = 0
        for nb, (p, out, start, top) in list(running.items()):
            rss = tree_rss(p.pid)[0]
            top[0], total = max(top[0], rss), total + rss
            if p.poll() is None:
                continue
            del running[nb]
            out.seek(0)
            text = '\n'.join(l for l in out.read().splitlines() if l.strip() != 'Success.')
            ok = p.returncode == 0
            name = os.path.relpath(nb)
            print(f'{name}: {"ok" if ok else "FAILED"}, {time.monotonic() - start:.0f} s, {top[0] / GB:.2f} GB peak')
            if text.strip():
                print('    ' + text.replace('\n', '\n    '))
            sys.stdout.flush()
            if not ok:
                failed.append(name)
        peak = max(peak, total)
        if running:
            time.sleep(a.interval)
    print(
        f'nbdev-test: {len(failed)} failed, {time.monotonic() - t0:.0f} s, at most {peak / GB:.2f} GB resident in the '
        f'notebooks running at once ({a.jobs} at a time)'
    )
    if failed:
        print('failed:\n\t' + '\n\t'.join(failed))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
