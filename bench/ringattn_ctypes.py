"""The bench scripts' handle on ringattn's C API: raw calls on torch tensors, the structs and the
library check from the Python package of this tree (python/ringattn/_capi.py), which is where
they are defined. For attention as a differentiable torch op, use the package itself
(docs/python.md).

    from ringattn_ctypes import Ringattn
    ra = Ringattn("build/libringattn.so")
    o, lse = ra.forward(q, k, v, causal=True)             # q, k, v: [B, S, H, D] bf16/f16 CUDA
    dq, dk, dv = ra.backward(q, k, v, o, lse, do, causal=True)   # fp32 gradients
    o, lse = ra.forward(q, k, v, causal=True, window=(256, 0), document_starts=starts)

window=(left, right) and document_starts (int64 [count] or [batch, count] on q's device) are the
mask of ringattn.attention (docs/python.md); the backward takes the forward's.

v (and so o, do and dv) may have a head dim Dv of its own on the host (f32/f64 CPU tensors), as
multi-head latent attention's 192/128; the scale defaults to 1/sqrt(D) of q and k. The CUDA block
takes Dv == D only and says so.
"""
import math
import sys
from pathlib import Path

import torch

# This tree's package, whether or not (or whichever version) is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from ringattn._capi import (BackwardParams, ForwardParams, Library, RingattnError,  # noqa: E402
                            Tensor, describe, mask_fields)
from ringattn._ops import documents_for_c, window_pair  # noqa: E402

__all__ = ["BackwardParams", "ForwardParams", "Ringattn", "RingattnError", "Tensor", "describe"]


class Ringattn:
    """The library at `library`, its version checked against the package's (RingattnError)."""

    def __init__(self, library):
        self.library = Library(library)
        self.lib = self.library.lib

    def version(self):
        return self.library.version

    def _check(self, status):
        self.library.check(status)

    def _stream(self, t):
        return torch.cuda.current_stream().cuda_stream if t.is_cuda else None

    @staticmethod
    def _mask(window, document_starts):
        return mask_fields(*window_pair(window, "Ringattn"), documents_for_c(document_starts))

    def forward(self, q, k, v, causal=False, scale=None, q_start=0, k_start=0, window=None,
                document_starts=None):
        b, sq, h, d = q.shape
        o = q.new_empty(b, sq, h, v.shape[-1])  # O has V's head dim
        lse = torch.empty(b, h, sq, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                          device=q.device)
        p = ForwardParams(q=describe(q), k=describe(k), v=describe(v), o=describe(o),
                          lse=describe(lse), scale=1.0 / math.sqrt(d) if scale is None else scale,
                          causal=int(causal), combine=0, q_start=q_start, k_start=k_start,
                          **self._mask(window, document_starts))
        self.library.forward(p, self._stream(q))
        return o, lse

    def backward(self, q, k, v, o, lse, dout, causal=False, scale=None, deterministic=False,
                 q_start=0, k_start=0, window=None, document_starts=None):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        delta = torch.empty_like(lse)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        do_d, delta_d = describe(dout), describe(delta)
        self.library.backward_prepare(describe(o), do_d, delta_d, self._stream(q))
        p = BackwardParams(q=describe(q), k=describe(k), v=describe(v), dout=do_d,
                           lse=describe(lse), delta=delta_d, dq=describe(dq), dk=describe(dk),
                           dv=describe(dv), scale=1.0 / math.sqrt(q.shape[-1]) if scale is None
                           else scale, causal=int(causal), deterministic=int(deterministic),
                           q_start=q_start, k_start=k_start,
                           **self._mask(window, document_starts))
        self.library.backward(p, self._stream(q))
        return dq, dk, dv
