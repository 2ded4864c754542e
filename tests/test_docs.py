"The docs site: nbdev directives honoured (hidden cells gone, directive lines stripped), README as home, a page per module."

from __future__ import annotations
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
import pytest

pytest.importorskip('mkdocs')
pytest.importorskip('mkdocs_jupyter')
pytest.importorskip('material')
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
import build_docs  # noqa: E402 (from tools/, on the path above)


def nb(*cells):
    return {
        'cells': [
            {
                'cell_type': t,
                'metadata': {},
                'source': s,
                **({'outputs': [], 'execution_count': None} if t == 'code' else {}),
            }
            for t, s in cells
        ],
        'metadata': {},
        'nbformat': 4,
        'nbformat_minor': 5,
    }


DEMO = nb(
    ('markdown', '# Demo module\n> Summary line of the demo.'),
    ('code', '#| default_exp entrypoints.openai.demo'),
    ('code', '#| hide\nSECRET_SETUP_VALUE = 42'),
    ('code', '#|hide\nANOTHER_HIDDEN_THING = 1'),
    ('code', '#| export\ndef visible_api_function(x):\n    "Return x."\n    return x'),
    ('markdown', 'Some prose that explains the design.'),
    ('code', '#| eval: false\nvisible_api_function(3)'),
)


def test_clean_notebook():
    cleaned, module, title = build_docs.clean_notebook(DEMO)
    assert (module, title) == ('entrypoints.openai.demo', 'Demo module')
    text = json.dumps(cleaned)
    assert 'SECRET_SETUP_VALUE' not in text and 'ANOTHER_HIDDEN_THING' not in text and '#|' not in text
    assert [c['source'] for c in cleaned['cells'] if c['cell_type'] == 'code'] == [
        'def visible_api_function(x):\n    "Return x."\n    return x',
        'visible_api_function(3)',
    ]


def test_build_site(tmp_path):
    nbs = tmp_path / 'nbs'
    nbs.mkdir()
    (nbs / '90_demo.ipynb').write_text(json.dumps(DEMO))
    shutil.copy(ROOT / 'nbs' / '77_api_server.ipynb', nbs)
    (nbs / '95_notes.ipynb').write_text(json.dumps(nb(('markdown', '# Loose notes'), ('code', '1 + 1'))))
    readme = tmp_path / 'README.md'
    readme.write_text('# cvllm_lab\n\nThe README is the HOME_PAGE_MARKER.\n')
    site = tmp_path / 'site'
    yml = build_docs.build(nbs, readme, tmp_path / 'build', site)
    nav = json.loads(yml.read_text())['nav']
    assert nav[0] == {'Home': 'index.md'}
    assert nav[1]['API'] == [
        {
            'cvllm_lab.entrypoints.openai': [
                {'api_server — OpenAI-compatible API server': '77_api_server.ipynb'},
                {'demo — Demo module': '90_demo.ipynb'},
            ]
        }
    ]
    assert nav[2] == {'Notebooks': [{'Loose notes': '95_notes.ipynb'}]}
    home = (site / 'index.html').read_text()
    assert 'HOME_PAGE_MARKER' in home and '90_demo.html' in home and '77_api_server.html' in home
    demo = (site / '90_demo.html').read_text()
    assert 'visible_api_function' in demo and 'Some prose that explains the design' in demo
    assert 'SECRET_SETUP_VALUE' not in demo and 'ANOTHER_HIDDEN_THING' not in demo
    assert not re.search(r'#\s*\|\s*(export|default_exp|hide|eval)', demo)
    api = (site / '77_api_server.html').read_text()
    assert 'build_app' in api and 'class OpenAIServing' in api
    assert 'def check_error' not in api  # defined in a `#| hide` cell of that notebook
    assert not re.search(r'#\s*\|\s*(export|default_exp|hide)', api)
    # 404.html: relative links like every other page's, so the site works from file:// too
    nf = (site / '404.html').read_text()
    assert not re.search(r'(href|src)="/(?!/)', nf) and '"base": "."' in nf and 'href="90_demo.html"' in nf
    assert not [p.name for p in site.glob('*.html') if build_docs.raw_tables(p.read_text())]


TABLE = '| a | b |\n|---|---|\n| 1 | 2 |'
BROKEN = {  # how a markdown table ends up as pipe text in the site (mkdocs-jupyter renders with mistune)
    'pipe_in_code': "| token | text |\n|---|---|\n| `<|python_tag|>` | Llama's |",  # a | splits cells even in backticks
    'in_list_item': f'- an item\n\n  {TABLE.replace(chr(10), chr(10) + "  ")}\n\n- another',  # no tables in list items
    'blank_line_inside': '| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |',  # the last row alone, as a paragraph
}


def test_raw_tables(tmp_path, capfd):
    "The build warns about, and `raw_tables` finds, tables left as pipe text; rendered ones and code are not flagged."
    nbs = tmp_path / 'nbs'
    nbs.mkdir()
    good = nb(
        ('markdown', f'# Good\n\n{TABLE}\n\n- an item\n\n{TABLE}'), ('code', 'x = """\n| a | b |\n|---|---|\n"""')
    )
    (nbs / '90_good.ipynb').write_text(json.dumps(good))
    for i, (name, md) in enumerate(BROKEN.items()):
        (nbs / f'9{i + 1}_{name}.ipynb').write_text(json.dumps(nb(('markdown', f'# {name}\n\n{md}'))))
    site = tmp_path / 'site'
    build_docs.build(nbs, tmp_path / 'README.md', tmp_path / 'build', site)
    assert build_docs.raw_tables((site / '90_good.html').read_text()) == []
    assert '<table>' in (site / '90_good.html').read_text()
    err = capfd.readouterr().err
    for i, name in enumerate(BROKEN):
        page = f'9{i + 1}_{name}.html'
        assert build_docs.raw_tables((site / page).read_text()), name
        assert f'{page}: a markdown table did not render' in err, (name, err)
    assert '90_good' not in err


def test_make_docs(tmp_path):
    "The whole site, as `make docs` builds it: a page per notebook."
    site = tmp_path / 'site'
    out = subprocess.run(
        ['make', '-s', 'docs', f'SITE_DIR={site}', f'PYTHON={sys.executable}'],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # progress per page, then where the site is and how to serve it
    n = len(list((ROOT / 'nbs').glob('*.ipynb'))) + 1
    assert f'[{n}/{n}] ' in out.stdout and '] 00_config.ipynb (' in out.stdout, out.stdout[-2000:]
    assert f'into {site}/' in out.stdout and 'make serve-docs' in out.stdout
    assert not [l for l in out.stderr.splitlines() if 'did not render' in l]  # every markdown table became a table
    pages = {p.stem for p in site.glob('*.html')}
    assert {p.stem for p in (ROOT / 'nbs').glob('*.ipynb')} <= pages and 'index' in pages
    assert 'def check_error' not in (site / '77_api_server.html').read_text()
    # every module docstring's `Docs:` link names a page the build produced (its markdown twin)
    links = {
        m.group(1)
        for f in (ROOT / 'cvllm_lab').rglob('*.py')
        if (m := re.search(r'Docs: https?://[^\s"]+/([^/\s"]+\.html\.md)', f.read_text()))
    }
    assert len(links) > 40 and not [l for l in links if not (site / l).exists()]
    reg = (site / 'registry.html.md').read_text()
    assert reg.startswith('# Model registry') and '```python' in reg and '#|' not in reg
