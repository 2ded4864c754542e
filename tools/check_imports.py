#!/usr/bin/env python
"""Check the library's floors: no module imports a module on a higher floor, and no import loops.

    python tools/check_imports.py            # exit 1 with the offending imports, else a one-line summary
    python tools/check_imports.py --graph    # also print each module's imports of the project

Every `import` counts, at module level or inside a function (a lazy import hides a loop, it does not remove it).
The floors, lowest first (a module may import its own floor and the ones below):

| floor | packages | what lives there |
|---|---|---|
| 0 | `kernels` | Triton kernels and their PyTorch references, layouts, tuned configs |
| 1 | `envs`, `config`, `sampling_params`, `utils`, `tokenizer` | environment variables, settings, the forward context, tokenizers |
| 2 | `layers` | norms, linears, rotary, attention, sampler |
| 3 | `quant` | quantized linears and the formats' converters |
| 4 | `models` | model families over the layers |
| 5 | `weights` | loading checkpoints into models (and quantizing them) |
| 6 | `engine` | request, KV cache manager, scheduler, model runner, engines |
| 7 | `entrypoints`, `bench` | offline `LLM`, CLIs, the OpenAI server, benchmarks |
"""

from __future__ import annotations
import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = 'cvllm_lab'
FLOORS = {
    'kernels': 0,
    'envs': 1,
    'config': 1,
    'sampling_params': 1,
    'utils': 1,
    'tokenizer': 1,
    'layers': 2,
    'quant': 3,
    'models': 4,
    'weights': 5,
    'engine': 6,
    'entrypoints': 7,
    'bench': 7,
}
SKIP = {'_modidx'}  # nbdev's symbol index, no imports


def modules() -> dict[str, Path]:
    "Dotted module name -> source file, for the library and `kernels/` (installed as `cvllm_lab.kernels`)."
    out = {}
    for base, prefix in ((ROOT / PKG, PKG), (ROOT / 'kernels', f'{PKG}.kernels')):
        for f in sorted(base.rglob('*.py')):
            parts = list(f.relative_to(base).with_suffix('').parts)
            if parts[-1] == '__init__':
                parts = parts[:-1]
            if parts and parts[-1] in SKIP:
                continue
            out['.'.join([prefix, *parts])] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    "The project modules that `name` imports anywhere in its file (relative imports resolved)."
    is_pkg = path.name == '__init__.py'
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                pkg = name.split('.') if is_pkg else name.split('.')[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = '.'.join(pkg + ([base] if base else []))
            cands = [f'{base}.{a.name}' for a in node.names] + [base]
        else:
            continue
        for c in cands:
            while c and c not in known:
                c = c.rpartition('.')[0]  # `from pkg import name` -> pkg's module
            if c and c != name:
                found.add(c)
    return found


def floor(mod: str) -> int | None:
    parts = mod.split('.')
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    "Strongly connected components with more than one module (Tarjan)."
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def check(verbose: bool = False) -> list[str]:
    "The problems found: imports from a lower floor to a higher one, unknown packages, import loops."
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    problems = []
    for m, deps in sorted(graph.items()):
        if verbose:
            print(f'{m}: {", ".join(sorted(deps)) or "-"}')
        fm = floor(m)
        if fm is None and m != PKG:
            problems.append(f'{m}: not on any floor (add its package to FLOORS)')
        for d in sorted(deps):
            fd = floor(d)
            if m != PKG and fm is not None and fd is not None and fd > fm:
                problems.append(f'{m} (floor {fm}) imports {d} (floor {fd})')
    problems += [f'import loop: {" <-> ".join(c)}' for c in cycles(graph)]
    return problems


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--graph', action='store_true', help="print each module's project imports")
    problems = check(ap.parse_args().graph)
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f'imports: {len(modules())} modules, floors respected, no loops')
