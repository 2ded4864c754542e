#!/usr/bin/env python
"""Check that no module reads another module's private attributes: `obj._name`, where `obj` is not `self`, `cls` or
`super()` and `_name` (not a dunder) is defined by the project in some other module but not in this one.

    python tools/check_private.py     # exit 1 with each new reach-in; allowlisted ones are listed, not failed

A private name is an implementation detail of the module that defines it: a class's `_attn_fn` rebound from another
module, or a runner's `_load` called from an engine, ties the two so that a refactor of one silently breaks the
other. The heuristic (an AST walk, no types) counts as "defined in a module" every `_name` that module assigns as an
attribute (`x._name = ...`), defines as a function, method or class, or binds at module or class level. Access to
other libraries' privates (`torch._C`) is not the project's business and is not reported. Notebook-generated
modules are checked as generated (`cvllm_lab/`), with `kernels/`.

`ALLOWLIST` holds known reach-ins as `path: obj._name` (line numbers move, the text does not); an entry that no
longer occurs is reported as stale so the list only shrinks.
"""

from __future__ import annotations
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = ('cvllm_lab', 'kernels')
SELFISH = {'self', 'cls'}

ALLOWLIST: set[str] = set()


def sources() -> dict[str, ast.Module]:
    out = {}
    for d in DIRS:
        for f in sorted((ROOT / d).rglob('*.py')):
            if f.name == '_modidx.py':
                continue
            out[str(f.relative_to(ROOT))] = ast.parse(f.read_text(), str(f))
    return out


def private(name: str) -> bool:
    return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def defined(tree: ast.Module) -> set[str]:
    "The private names a module defines: attributes it assigns, functions, classes, module- and class-level names."
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and owner(n.value) is None:
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split('.')[0] for a in n.names)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ('setattr', 'getattr', 'hasattr')
            and len(n.args) > 1
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
        ):
            if n.func.id == 'setattr' and owner(n.args[0]) is None:
                out.add(n.args[1].value)
    return {x for x in out if private(x)}


def owner(node: ast.expr) -> str | None:
    "The text of `obj` in `obj._name`, or None where `obj` is `self`, `cls` or `super()`."
    if isinstance(node, ast.Name) and node.id in SELFISH:
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'super':
        return None
    return ast.unparse(node)


def reach_ins(trees: dict[str, ast.Module]) -> list[tuple[str, int, str, list[str]]]:
    "`(path, line, 'obj._name', modules defining _name)` for each read of another module's private name."
    defs = {p: defined(t) for p, t in trees.items()}
    where = defaultdict(list)
    for p, names in defs.items():
        for n in names:
            where[n].append(p)
    out = []
    for p, t in trees.items():
        for n in ast.walk(t):
            if not (isinstance(n, ast.Attribute) and private(n.attr)) or n.attr in defs[p] or n.attr not in where:
                continue
            o = owner(n.value)
            if o is not None:
                out.append((p, n.lineno, f'{o}.{n.attr}', where[n.attr]))
    return sorted(out)


def selftest():
    "The heuristic on two small modules: a read and a write from outside count, `self`/`super()`/dunders do not."
    a = ast.parse('class A:\n    def __init__(self): self._x = 1\n    def f(self): return self._x, super()._x\n')
    b = ast.parse('def g(a):\n    a._x = 2\n    return a._x, a.__dict__, a._unknown, torch._C\n')
    got = [(p, t) for p, _, t, _ in reach_ins({'a.py': a, 'b.py': b})]
    assert got == [('b.py', 'a._x'), ('b.py', 'a._x')], got


def check(verbose: bool = True) -> list[str]:
    "Problems: reach-ins not in `ALLOWLIST` (allowlisted ones and stale entries printed when `verbose`)."
    selftest()
    found = reach_ins(sources())
    problems, seen = [], set()
    for p, line, text, defs in found:
        key = f'{p}: {text}'
        seen.add(key)
        msg = f'{p}:{line}: {text} reaches into a private name of {", ".join(defs[:3])}'
        if key in ALLOWLIST:
            if verbose:
                print(f'allowlisted: {msg}')
        else:
            problems.append(msg + ' (use a public method, or add it to tools/check_private.py ALLOWLIST)')
    if verbose:
        for k in sorted(ALLOWLIST - seen):
            print(f'stale allowlist entry (remove it): {k}')
    return problems


if __name__ == '__main__':
    problems = check()
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"private names: no module reaches into another module's ({len(ALLOWLIST)} allowlisted)")
