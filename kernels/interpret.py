"""Whether the Triton kernels run under Triton's interpreter: decided once, here, for the whole library.

`TRITON_INTERPRET=1` runs every `@triton.jit` function as Python on CPU tensors; Triton reads the variable when a
function is decorated. Set by hand (`1` or `0`), it is obeyed. Unset, it is set to `1` when no CUDA device is
visible, so a notebook or script that uses a kernel works on a CPU-only machine as it is. The package
(`cvllm_lab.kernels`) imports this module before any kernel module, and every kernel module reads `INTERPRET` from
here rather than the environment. The decision is for the process: the variable is read by Triton, not only by us.
"""

import os

__all__ = ['INTERPRET', 'decide']


def decide(environ=None, cuda_available=None) -> bool:
    """Whether to interpret, and `environ` (default `os.environ`) made to say so: `TRITON_INTERPRET` as set, else on
    exactly when `cuda_available` (default: `torch.cuda.is_available()`) is False, which then sets the variable."""
    env = os.environ if environ is None else environ
    if 'TRITON_INTERPRET' not in env:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if cuda_available:
            return False
        env['TRITON_INTERPRET'] = '1'
    return env['TRITON_INTERPRET'] == '1'


INTERPRET = decide()
