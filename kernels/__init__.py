"""Hand-written Triton kernels, each with a plain-PyTorch reference.

Without a CUDA GPU the kernels run under Triton's interpreter (on CPU tensors): `TRITON_INTERPRET=1` is set here,
before any kernel module defines its `@triton.jit` functions (the variable is read then), unless it is set already.
So a notebook or script that uses a kernel works on a CPU-only machine as it is."""
import os

if 'TRITON_INTERPRET' not in os.environ:
    import torch
    if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'
