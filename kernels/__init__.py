"""Hand-written Triton kernels, each with a plain-PyTorch reference.

Without a CUDA GPU the kernels run under Triton's interpreter (on CPU tensors): `interpret.py` decides that, once,
before any kernel module defines its `@triton.jit` functions (Triton reads `TRITON_INTERPRET` then), and sets the
variable unless it is set already. So a notebook or script that uses a kernel works on a CPU-only machine as it is.

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
    try:
        sys.modules['kernels'] = importlib.import_module('kernels')  # the import returns what sys.modules holds
    except ImportError:
        sys.modules['kernels'] = _self
    finally:
        sys.path[:] = _path
else:
    from . import interpret  # noqa: F401  (the interpreter decision, before any kernel is defined)
