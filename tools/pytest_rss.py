"""A pytest plugin that reports the test process's resident memory per test file: `PYTHONPATH=tools pytest -p pytest_rss`.

After each test it reads the process's resident set (`VmRSS`) and its high-water mark (`VmHWM`); at the end it
prints, per test file, the resident set when its last test finished, the growth over the file and the high-water
mark reached while it ran (in the order they ran), so a file whose models outlive its tests shows up as a step
that never comes back down.
"""

from __future__ import annotations

GB = 1e9
_rows: dict[str, list[float]] = {}


def _status() -> tuple[float, float]:
    got = {}
    with open('/proc/self/status') as f:
        for l in f:
            if l.startswith(('VmRSS', 'VmHWM')):
                got[l.split(':')[0]] = int(l.split()[1]) * 1024 / GB
    return got['VmRSS'], got['VmHWM']


_last = [_status()[0]]


def pytest_runtest_logfinish(nodeid, location):
    rss, hwm = _status()
    row = _rows.setdefault(nodeid.split('::')[0], [_last[0], rss, hwm])
    row[1], row[2] = rss, max(row[2], hwm)
    _last[0] = rss


def pytest_terminal_summary(terminalreporter):
    w = terminalreporter.write_line
    w('resident memory of the test process per file (GB): start -> end (growth), high-water mark so far')
    for f, (a, b, h) in _rows.items():
        w(f'  {f}: {a:.2f} -> {b:.2f} ({b - a:+.2f}), {h:.2f}')
