#!/usr/bin/env python
"""Build the docs site from the notebooks with mkdocs-material + mkdocs-jupyter, honouring nbdev's directives.

    python tools/build_docs.py                 # -> site/ (what `make docs` runs)
    python tools/build_docs.py --serve         # build, then serve with `mkdocs serve`

Steps: copy every nbs/*.ipynb into a build folder with nbdev's directives applied (`#| hide` cells dropped,
directive lines such as `#| export` / `#| default_exp` stripped, emptied cells dropped); the README becomes the
home page; a generated mkdocs.yml has one API page per module (the module's notebook, under its package) and
the notebooks that export nothing under "Notebooks"; then `mkdocs build`. Notebooks are not executed: the site
shows the outputs stored in them (nbdev-clean keeps them empty, so it shows code and prose). Each notebook is also
written as plain markdown at the address nbdev puts in its module's docstring (`Docs: .../<name>.html.md`, the
number prefix dropped), for readers and tools that want the chapter as text.
"""

from __future__ import annotations
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENV = dict(os.environ, NO_MKDOCS_2_WARNING='1')
DIRECTIVE = re.compile(r'^\s*#\s*\|\s*([\w-]+)(.*)$')


def directives(src: str) -> dict[str, str]:
    "nbdev directives of a cell (`#| name args` lines) -> {name: args}."
    out = {}
    for line in src.splitlines():
        m = DIRECTIVE.match(line)
        if m:
            out[m.group(1)] = m.group(2).strip(' :')
    return out


def clean_notebook(nb: dict) -> tuple[dict, str | None, str]:
    "The notebook as the docs show it, its module (`default_exp`) and its title."
    module, title, cells = None, None, []
    for c in nb['cells']:
        src = ''.join(c.get('source', ''))
        d = directives(src) if c['cell_type'] == 'code' else {}
        if 'default_exp' in d:
            module = d['default_exp'].split()[0]
        if 'hide' in d or 'include' in d and d['include'].lower() == 'false':
            continue
        if c['cell_type'] == 'code':
            src = '\n'.join(l for l in src.splitlines() if not DIRECTIVE.match(l)).strip('\n')
            if not src.strip():
                continue
            c = {**c, 'source': src}
        elif c['cell_type'] == 'markdown' and title is None:
            m = re.search(r'^#\s+(.+)$', src, re.M)
            if m:
                title = m.group(1).strip()
        cells.append(c)
    return {**nb, 'cells': cells}, module, title


def notebook_markdown(nb: dict) -> str:
    "A cleaned notebook as markdown: markdown cells as they are, code cells fenced."
    parts = []
    for c in nb['cells']:
        src = ''.join(c.get('source', '')).strip('\n')
        if src:
            parts.append(src if c['cell_type'] == 'markdown' else f'```python\n{src}\n```')
    return '\n\n'.join(parts) + '\n'


def md_name(nb_file: str) -> str:
    "The file nbdev's docstring link names for a notebook: `32_registry.ipynb` -> `registry.html.md`."
    from nbdev.config import nbpath2html

    return f'{nbpath2html(Path(nb_file)).as_posix()}.md'


def mkdocs_yml(site_name: str, nav: list, site_dir: Path) -> str:
    cfg = {
        'site_name': site_name,
        'site_dir': str(site_dir),
        'docs_dir': 'docs',
        'use_directory_urls': False,
        'theme': {
            'name': 'material',
            'font': False,  # no Google fonts: the site works offline
            'features': [
                'navigation.sections',
                'navigation.expand',
                'navigation.top',
                'search.highlight',
                'content.code.copy',
            ],
            'palette': [
                {'scheme': 'default', 'toggle': {'icon': 'material/brightness-7', 'name': 'Dark mode'}},
                {'scheme': 'slate', 'toggle': {'icon': 'material/brightness-4', 'name': 'Light mode'}},
            ],
        },
        'plugins': [
            'search',
            {
                'mkdocs-jupyter': {
                    'execute': False,
                    'include_source': False,
                    'ignore_h1_titles': False,
                    'include_requirejs': False,
                }
            },
        ],
        'markdown_extensions': ['tables', 'admonition', 'pymdownx.superfences', 'pymdownx.highlight', 'toc'],
        'nav': nav,
    }
    return json.dumps(cfg, indent=1)  # JSON is valid YAML


def build(
    nbs: Path = ROOT / 'nbs',
    readme: Path = ROOT / 'README.md',
    build_dir: Path = ROOT / 'build' / 'docs',
    site_dir: Path = ROOT / 'site',
    only: list[str] | None = None,
    run: bool = True,
) -> Path:
    "Prepare the docs sources and mkdocs.yml in `build_dir`, then build the site into `site_dir`; returns mkdocs.yml."
    if build_dir.exists():
        shutil.rmtree(build_dir)
    docs = build_dir / 'docs'
    docs.mkdir(parents=True)
    home = readme.read_text() if readme.exists() else '# cvllm_lab\n'
    (docs / 'index.md').write_text(home)
    packages: dict[str, list] = {}
    notebooks, markdown = [], {}
    for f in sorted(nbs.glob('*.ipynb')):
        if only and not any(o in f.name for o in only):
            continue
        nb, module, title = clean_notebook(json.loads(f.read_text()))
        (docs / f.name).write_text(json.dumps(nb, indent=1))
        markdown[md_name(f.name)] = notebook_markdown(nb)
        if module:
            pkg, _, name = module.rpartition('.')
            packages.setdefault(pkg or 'cvllm_lab', []).append({f'{module.split(".")[-1]} — {title or name}': f.name})
        else:
            notebooks.append({title or f.stem: f.name})
    nav = [
        {'Home': 'index.md'},
        {'API': [{k if k == 'cvllm_lab' else f'cvllm_lab.{k}': v} for k, v in packages.items()]},
    ]
    if notebooks:
        nav.append({'Notebooks': notebooks})
    yml = build_dir / 'mkdocs.yml'
    yml.write_text(mkdocs_yml('cvllm_lab', nav, site_dir.resolve()))
    if run:
        subprocess.run(
            [sys.executable, '-m', 'mkdocs', 'build', '--quiet', '-f', str(yml)], check=True, cwd=build_dir, env=_ENV
        )
        for name, text in markdown.items():
            (site_dir / name).write_text(text)
    return yml


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--nbs', type=Path, default=ROOT / 'nbs')
    p.add_argument('--readme', type=Path, default=ROOT / 'README.md')
    p.add_argument('--build-dir', type=Path, default=ROOT / 'build' / 'docs')
    p.add_argument('--site-dir', type=Path, default=ROOT / 'site')
    p.add_argument('--only', nargs='+', help='only notebooks whose file name contains one of these')
    p.add_argument('--serve', action='store_true', help='serve the site with live reload after building')
    p.add_argument('--port', type=int, default=8008)
    a = p.parse_args(argv)
    yml = build(a.nbs, a.readme, a.build_dir, a.site_dir, a.only)
    print(f'docs built into {a.site_dir}')
    if a.serve:
        subprocess.run(
            [sys.executable, '-m', 'mkdocs', 'serve', '-f', str(yml), '-a', f'127.0.0.1:{a.port}'],
            cwd=a.build_dir,
            env=_ENV,
        )


if __name__ == '__main__':
    main()
