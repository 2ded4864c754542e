"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is still
running. Every such kernel calls `pdl_wait(PDL)` before its first read *or write* of activations
(`griddepcontrol.wait` returns once the predecessor grid has completed and its writes are visible; since the
predecessor itself waited on its own predecessor, the whole chain before it is complete too), then
`pdl_launch(PDL)` (its successor may be scheduled once all of this grid's programs have got there). Launching
after the wait keeps the chain at most one kernel ahead, rather than letting several kernels' programs pile up,
prefetching. Only weights, which no kernel writes, may be read before the wait: the quantized GEMVs issue their
first weight loads there. In a CUDA graph this hides each kernel's launch latency and ramp behind the tail of the
previous one (a Llama-3-8B decode step is about 290 kernels). A kernel launched without the attribute (cuBLAS,
PyTorch ops) is ordered as usual. The group-32 GEMV (q4_k, q4_0, q8_0 repacks) launches without PDL, where it
gained nothing (`results/NOTES.md`).

Off under the Triton interpreter, before sm_90, and with the environment variable `CVLLM_PDL=0`. Launchers take
`pdl=True` to force the kernels' PDL code paths (the interpreter then skips only the two instructions), so the CPU
tests cover them too.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.interpret import INTERPRET

__all__ = ['pdl_kw', 'pdl_on', 'pdl_wait', 'pdl_launch']
_INTERPRET = tl.constexpr(INTERPRET)
PDL_ENABLED = os.environ.get('CVLLM_PDL', '1') != '0'  # read once, at import (`cvllm_lab.envs` lists it)


@functools.lru_cache(None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device) -> bool:
    "Whether kernels on `device` are launched with PDL."
    if device.type != 'cuda' or INTERPRET or not PDL_ENABLED:
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def pdl_kw(device, pdl=None) -> dict:
    "Launch keywords: the kernel's `PDL` constexpr (`pdl`, default `pdl_on`) and, on a GPU, Triton's `launch_pdl`."
    on = pdl_on(device) if pdl is None else bool(pdl)
    return dict(PDL=on, launch_pdl=True) if on and device.type == 'cuda' and not _INTERPRET else dict(PDL=on)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    "Wait for the previous kernel in the stream (no-op without PDL)."
    if PDL and not _INTERPRET:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch(PDL: tl.constexpr):
    "Allow the next kernel in the stream to be scheduled (no-op without PDL)."
    if PDL and not _INTERPRET:
        tl.extra.cuda.gdc_launch_dependents()
