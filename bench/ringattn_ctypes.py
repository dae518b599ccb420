"""ringattn's C API from Python through ctypes, on torch tensors (no extension module needed).

    from ringattn_ctypes import Ringattn
    ra = Ringattn("build/libringattn.so")
    o, lse = ra.forward(q, k, v, causal=True)             # q, k, v: [B, S, H, D] bf16/f16 CUDA
    dq, dk, dv = ra.backward(q, k, v, o, lse, do, causal=True)   # fp32 gradients

v (and so o, do and dv) may have a head dim Dv of its own on the host (f32/f64 CPU tensors), as
multi-head latent attention's 192/128; the scale defaults to 1/sqrt(D) of q and k. The CUDA block
takes Dv == D only and says so.
"""
import ctypes
import math

import torch

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("memory", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4)]


class ForwardParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("o", Tensor), ("lse", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32), ("combine", ctypes.c_int32),
                ("q_start", ctypes.c_int64), ("k_start", ctypes.c_int64)]


class BackwardParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("dout", Tensor), ("lse", Tensor), ("delta", Tensor), ("dq", Tensor),
                ("dk", Tensor), ("dv", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32), ("deterministic", ctypes.c_int32),
                ("q_start", ctypes.c_int64), ("k_start", ctypes.c_int64),
                ("overwrite_key_gradients", ctypes.c_int32),
                ("key_rotation_cos", Tensor), ("key_rotation_sin", Tensor)]


def describe(t):
    d = Tensor()
    d.data = t.data_ptr()
    d.dtype = _DTYPES[t.dtype]
    d.memory = 1 if t.is_cuda else 0
    d.rank = t.dim()
    for i in range(t.dim()):
        d.shape[i] = t.shape[i]
        d.strides[i] = t.stride(i)
    return d


class Ringattn:
    def __init__(self, library):
        self.lib = ctypes.CDLL(library)
        self.lib.ringattn_last_error.restype = ctypes.c_char_p
        self.lib.ringattn_version_string.restype = ctypes.c_char_p
        for name in ("ringattn_attention_forward", "ringattn_attention_backward"):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ringattn_attention_backward_prepare.argtypes = [ctypes.c_void_p] * 4

    def version(self):
        return self.lib.ringattn_version_string().decode()

    def _check(self, status):
        if status != 0:
            raise RuntimeError(f"ringattn status {status}: {self.lib.ringattn_last_error().decode()}")

    def _stream(self, t):
        return torch.cuda.current_stream().cuda_stream if t.is_cuda else None

    def forward(self, q, k, v, causal=False, scale=None, q_start=0, k_start=0):
        b, sq, h, d = q.shape
        o = q.new_empty(b, sq, h, v.shape[-1])  # O has V's head dim
        lse = torch.empty(b, h, sq, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                          device=q.device)
        p = ForwardParams(ctypes.sizeof(ForwardParams), describe(q), describe(k), describe(v),
                          describe(o), describe(lse), scale or 1.0 / math.sqrt(d), int(causal), 0,
                          q_start, k_start)
        self._check(self.lib.ringattn_attention_forward(ctypes.byref(p), self._stream(q)))
        return o, lse

    def backward(self, q, k, v, o, lse, dout, causal=False, scale=None, deterministic=False,
                 q_start=0, k_start=0):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        delta = torch.empty_like(lse)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        do_d, o_d, delta_d = describe(dout), describe(o), describe(delta)
        self._check(self.lib.ringattn_attention_backward_prepare(
            ctypes.byref(o_d), ctypes.byref(do_d), ctypes.byref(delta_d), self._stream(q)))
        p = BackwardParams(ctypes.sizeof(BackwardParams), describe(q), describe(k), describe(v),
                           do_d, describe(lse), delta_d, describe(dq), describe(dk), describe(dv),
                           scale or 1.0 / math.sqrt(q.shape[-1]), int(causal), int(deterministic),
                           q_start, k_start)
        self._check(self.lib.ringattn_attention_backward(ctypes.byref(p), self._stream(q)))
        return dq, dk, dv
