"""Hand-written Triton kernels, each with a plain-PyTorch reference.

Without a CUDA GPU the kernels run under Triton's interpreter (on CPU tensors): `TRITON_INTERPRET=1` is set here,
before any kernel module defines its `@triton.jit` functions (the variable is read then), unless it is set already.
So a notebook or script that uses a kernel works on a CPU-only machine as it is.

Run from the repository's root (`python -m ...`, a notebook or shell started there), this directory could also be
imported as a top-level `kernels`: a name that belongs to Hugging Face's kernel hub package, which `transformers`
imports when it is installed. Imported under that name, this module hands the import over to the installed
package (or stays, where there is none)."""
import os
import sys

if __name__ == 'kernels':
    import importlib
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _self, _path = sys.modules.pop('kernels'), sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != _root]
    try: sys.modules['kernels'] = importlib.import_module('kernels')   # the import returns what sys.modules holds
    except ImportError: sys.modules['kernels'] = _self
    finally: sys.path[:] = _path
elif 'TRITON_INTERPRET' not in os.environ:
    import torch
    if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'
