"""Test-only: every Python process started with this folder on PYTHONPATH fills `torch.empty` storage with NaN
(integers with their largest value), so a test that reads memory nobody wrote fails every time rather than on
the rare run where the allocator hands back an inf. `scripts/test.sh` puts it on the path; the library never sees it.
Only determinism's memory fill is wanted: `warn_only` keeps ops without a deterministic kernel running as before."""

try:
    import torch
    import torch.utils.deterministic
except ImportError:  # a Python without torch (a tool's own interpreter): nothing to fill
    pass
else:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
