#!/usr/bin/env python
"""Build the docs site from the notebooks with mkdocs-material + mkdocs-jupyter, honouring nbdev's directives.

    python tools/build_docs.py                 # -> site/ (what `make docs` runs)
    python tools/build_docs.py --serve         # build, then serve with `mkdocs serve` (what `make serve-docs` runs)

Steps: copy every nbs/*.ipynb into a build folder with nbdev's directives applied (`#| hide` cells dropped,
directive lines such as `#| export` / `#| default_exp` stripped, emptied cells dropped); the README becomes the
home page; a generated mkdocs.yml has one API page per module (the module's notebook, under its package) and
the notebooks that export nothing under "Notebooks"; then `mkdocs build`. Notebooks are not executed: the site
shows the outputs stored in them (nbdev-clean keeps them empty, so it shows code and prose). Each notebook is also
written as plain markdown at the address nbdev puts in its module's docstring (`Docs: .../<name>.html.md`, the
number prefix dropped), for readers and tools that want the chapter as text.

The build prints a line per page as mkdocs-jupyter converts it (this file is also the mkdocs hook that prints them),
keeps the converted pages in a cache beside the build folder (`build/docs-cache`: a rebuild converts only the notebooks
that changed; delete it after upgrading mkdocs-jupyter or nbconvert), rewrites `404.html`'s root-absolute links as relative ones (so the site also works from `file://`),
and warns about markdown tables that did not render (`raw_tables`: a table row left as text in a paragraph).
"""

from __future__ import annotations
import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
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


def mkdocs_yml(site_name: str, nav: list, site_dir: Path, cache_dir: Path | None = None) -> str:
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
                    **({'cache_dir': str(cache_dir)} if cache_dir else {}),
                }
            },
        ],
        'markdown_extensions': ['tables', 'admonition', 'pymdownx.superfences', 'pymdownx.highlight', 'toc'],
        'nav': nav,
        'hooks': [str(Path(__file__).resolve())],  # on_startup, on_files, on_pre_page, on_page_content below
    }
    return json.dumps(cfg, indent=1)  # JSON is valid YAML


# ---- mkdocs hooks (mkdocs.yml lists this file under `hooks`): one line per page while the site builds ----
_pages = {'n': 0, 'done': 0, 't': 0.0}


def on_startup(command, dirty):
    logging.getLogger('mkdocs.plugins.mkdocs_jupyter').setLevel(logging.WARNING)  # a "Cache hit" line per page


def on_files(files, config):
    _pages.update(n=sum(f.src_uri.endswith(('.ipynb', '.md')) for f in files), done=0)
    print(f'converting {_pages["n"]} pages (notebooks with mkdocs-jupyter; cached ones are quick)', flush=True)


def on_pre_page(page, config, files):
    _pages['t'] = time.perf_counter()


def on_page_content(html, page, config, files):
    _pages['done'] += 1
    n = _pages['n']
    dt = time.perf_counter() - _pages['t']
    print(f'[{_pages["done"]:{len(str(n))}}/{n}] {page.file.src_uri} ({dt:.1f} s)', flush=True)


# ---- checks and fixes of the built site ----
class _Text(HTMLParser):
    "A page's text, tags dropped, without code: `<pre>` blocks and mkdocs-jupyter's copy of each code cell's source."

    def __init__(self):
        super().__init__()
        self.parts, self.skip, self.depth = (
            [],
            None,
            0,
        )  # text pieces; the tag of the code element we are in, its nesting

    def handle_starttag(self, tag, attrs):
        if self.skip is None and (
            tag in ('pre', 'script', 'style', 'textarea') or 'clipboard-copy-txt' in (dict(attrs).get('class') or '')
        ):
            self.skip = tag
        self.depth += tag == self.skip

    def handle_endtag(self, tag):
        if tag == self.skip:
            self.depth -= 1
            if not self.depth:
                self.skip = None

    def handle_data(self, data):
        if self.skip is None:
            self.parts.append(data)


TABLE_ROW = re.compile(r'^\s*\|.*\|\s*$')


def raw_tables(html: str) -> list[str]:
    "Lines of a page's text that are markdown table rows left as text (`| a | b |`, `|---|---|`): tables that did not render."
    p = _Text()
    p.feed(html)
    return [l.strip() for l in ''.join(p.parts).splitlines() if TABLE_ROW.match(l) and l.count('|') >= 2]


def relative_404(site_dir: Path):
    "mkdocs writes 404.html with root-absolute links (`/assets/...`, `/00_config.html`); make them relative like the other pages'."
    f = site_dir / '404.html'
    if f.exists():
        t = re.sub(r'((?:href|src)=")/(?!/)', r'\1', f.read_text())
        t = t.replace('"base": "/"', '"base": "."').replace('"search": "/', '"search": "')
        f.write_text(t)


def build(
    nbs: Path = ROOT / 'nbs',
    readme: Path = ROOT / 'README.md',
    build_dir: Path = ROOT / 'build' / 'docs',
    site_dir: Path = ROOT / 'site',
    only: list[str] | None = None,
    run: bool = True,
    cache_dir: Path | None = None,
) -> Path:
    """Prepare the docs sources and mkdocs.yml in `build_dir`, then build the site into `site_dir`; returns mkdocs.yml.
    Converted notebooks are cached in `cache_dir` (default: `docs-cache` beside `build_dir`)."""
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
    cache_dir = (cache_dir or build_dir.parent / 'docs-cache').resolve()
    yml.write_text(mkdocs_yml('cvllm_lab', nav, site_dir.resolve(), cache_dir))
    if run:
        subprocess.run(
            [sys.executable, '-m', 'mkdocs', 'build', '--quiet', '-f', str(yml)], check=True, cwd=build_dir, env=_ENV
        )
        for name, text in markdown.items():
            (site_dir / name).write_text(text)
        relative_404(site_dir)
        for page in sorted(site_dir.glob('*.html')):
            for row in raw_tables(page.read_text())[:3]:
                print(f'warning: {page.name}: a markdown table did not render: {row[:100]}', file=sys.stderr)
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
    t0 = time.perf_counter()
    yml = build(a.nbs, a.readme, a.build_dir, a.site_dir, a.only)
    site = a.site_dir.resolve()
    print(f'docs built in {time.perf_counter() - t0:.0f} s into {site}/ ({len(list(site.glob("*.html")))} pages)')
    if not a.serve:
        print(f'  open {site / "index.html"} in a browser, or serve it with live reload: make serve-docs')
    else:
        print(f'serving at http://127.0.0.1:{a.port}/ (Ctrl+C stops)', flush=True)
        subprocess.run(
            [sys.executable, '-m', 'mkdocs', 'serve', '-f', str(yml), '-a', f'127.0.0.1:{a.port}'],
            cwd=a.build_dir,
            env=_ENV,
        )


if __name__ == '__main__':
    main()
