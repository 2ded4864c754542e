#!/usr/bin/env python3
"""Peak resident memory of a process tree, sampled from `/proc` (Linux; standard library only).

    python tools/peak_rss.py -- CMD ARGS...   # run CMD, print its tree's peak when it exits (exit status: CMD's)
    python tools/peak_rss.py --pid PID        # watch PID's tree until PID exits or SIGTERM/SIGINT arrives

Every `--interval` seconds (default 0.5) it sums the resident set (`/proc/PID/statm`) of the root and all its
descendants (the sampler itself excluded) and keeps the largest sum and the largest single process, then prints
one line (`--label` names it), then the processes that made the peak (those over 100 MB, with their command
lines) so the moment can be found. Pages shared between processes (forked workers) count once in each, so the total is
an upper bound of what the tree holds; a peak shorter than the interval can be missed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

PAGE = os.sysconf('SC_PAGE_SIZE')


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir('/proc'):
        if not d.isdigit():
            continue
        try:
            with open(f'/proc/{d}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _rss(pid: int) -> int:
    try:
        with open(f'/proc/{pid}/statm') as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read().replace(b'\0', b' ').decode(errors='replace').strip()[:160]
    except OSError:
        return '?'


def tree_rss(root: int) -> tuple[int, int, list[tuple[int, int]]]:
    "Total and largest resident bytes over `root` and its descendants (this process left out), and (rss, pid) each."
    kids, me = _children(), os.getpid()
    total = big = 0
    each = []
    todo = [root]
    while todo:
        p = todo.pop()
        if p != me:
            r = _rss(p)
            total, big = total + r, max(big, r)
            each.append((r, p))
        todo += kids.get(p, [])
    return total, big, each


def _alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--pid', type=int, help='watch this running process tree instead of starting a command')
    ap.add_argument('--interval', type=float, default=0.5)
    ap.add_argument('--label', default='peak memory')
    ap.add_argument('cmd', nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ['--'] else a.cmd
    if (a.pid is None) == (not cmd):
        ap.error('give either --pid PID or -- CMD')
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.append(1))
    proc = subprocess.Popen(cmd) if cmd else None
    root = proc.pid if proc else a.pid
    t0, peak, big, at_peak = time.monotonic(), 0, 0, []
    while not stop:
        total, one, each = tree_rss(root)
        if total > peak:  # who holds it, named now while the processes live
            at_peak = [(r, _cmdline(p)) for r, p in sorted(each, reverse=True) if r > 100e6]
        peak, big = max(peak, total), max(big, one)
        if proc.poll() is not None if proc else not _alive(root):
            break
        time.sleep(a.interval)
    rc = proc.wait() if proc else 0
    gb = 1e9
    print(
        f'{a.label}: {peak / gb:.2f} GB resident at most (the process tree summed; largest process {big / gb:.2f} GB;'
        f' sampled every {a.interval:g} s over {time.monotonic() - t0:.0f} s)',
        flush=True,
    )
    for r, cmd in at_peak:
        print(f'  {r / gb:5.2f} GB  {cmd}', flush=True)
    return rc


if __name__ == '__main__':
    sys.exit(main())
