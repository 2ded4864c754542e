"""Helpers shared by several test modules (`tests/` is on `sys.path` under pytest: `from helpers import ...`)."""


def rel_err(a, b) -> float:
    "`||a - b|| / ||b||` in fp32."
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
