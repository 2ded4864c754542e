"""Replace text in one notebook cell: `python tools/nbreplace.py NB OLDFILE NEWFILE` (the old text must occur in
exactly one cell, once); used for scripted edits that keep nbdev's JSON format."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nbedit import load, save, src, setsrc


def replace(nb_path: str, old: str, new: str):
    nb = load(nb_path)
    hits = [c for c in nb['cells'] if old in src(c)]
    if len(hits) != 1 or src(hits[0]).count(old) != 1:
        raise SystemExit(f'{nb_path}: {len(hits)} cells hold the old text')
    setsrc(hits[0], src(hits[0]).replace(old, new))
    save(nb, nb_path)


if __name__ == '__main__':
    replace(sys.argv[1], Path(sys.argv[2]).read_text(), Path(sys.argv[3]).read_text())
