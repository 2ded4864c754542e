"""Shared pytest setup: on a machine without CUDA, Triton kernels run under the interpreter. The variable is read
when a `@triton.jit` function is defined, so it must be set before any kernel module is imported."""
import os

try:
    import torch
    _cuda = torch.cuda.is_available()
except ImportError:
    _cuda = False
if not _cuda: os.environ.setdefault('TRITON_INTERPRET', '1')
