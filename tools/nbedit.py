"""Tiny notebook editor: load, find cells, replace/insert/delete, save in nbdev's format."""

import json
import uuid


def load(p):
    return json.load(open(p))


def save(nb, p):
    with open(p, 'w') as f:
        f.write(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')


def src(c):
    return ''.join(c['source'])


def setsrc(c, s):
    lines = s.split('\n')
    c['source'] = [l + '\n' for l in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def find(nb, needle):
    hits = [i for i, c in enumerate(nb['cells']) if needle in src(c)]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def cell(kind, s):
    c = {'cell_type': kind, 'id': uuid.uuid4().hex[:8], 'metadata': {}, 'source': []}
    if kind == 'code':
        c.update(execution_count=None, outputs=[])
    setsrc(c, s)
    return c


def code(s):
    return cell('code', s)


def md(s):
    return cell('markdown', s)


def insert_after(nb, i, *cells):
    for k, c in enumerate(cells):
        nb['cells'].insert(i + 1 + k, c)
