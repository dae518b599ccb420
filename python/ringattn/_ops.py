"""attention() as torch.library custom ops (ringattn::attention_forward and
ringattn::attention_backward) with fake (meta) implementations and autograd, so that autograd
and torch.compile(fullgraph=True) go through the same two calls of the C API; and, for plain
eager calls on real tensors, the same two implementations under a torch.autograd.Function
(eager_attention), which spares each call the custom ops' dispatch.
"""
import contextlib
import math
import operator
from typing import Optional

import torch
from torch import Tensor

from ringattn import _capi


def _accumulator_dtype(dtype):
    # The C API's accumulator dtype: f64 for f64 inputs, f32 for every other input dtype.
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensors(q, k, v, where):
    """q, k and v are torch tensors (TypeError naming the first that is not), before anything
    reads their shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}; expected a torch.Tensor "
                            "[batch, seq, heads, head_dim]")


def default_scale(q):
    """1 / sqrt(head_dim) of q; 1 where q has no head_dim to take it from (rank 0, or head_dim 0),
    so that the checks that follow name what is wrong."""
    return 1.0 / math.sqrt(max(q.shape[-1], 1)) if q.dim() else 1.0


def _check(q, k, v, document_starts=None):
    """What the descriptors and the outputs' shapes need; every other check (shapes that do not
    match, GQA, dtypes, memory, head dims, windows, the documents' order) is the library's, whose
    message names the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"ringattn.attention: {name} has shape {list(t.shape)}; expected "
                             "rank 4 [batch, seq, heads, head_dim]")
        if t.dtype not in _capi.DTYPE_CODES:
            raise TypeError(f"ringattn.attention: {name} has dtype {t.dtype}; expected "
                            "torch.float32 or torch.float64 (CPU), torch.bfloat16 or "
                            "torch.float16 (CUDA)")
        if t.device != q.device:
            raise ValueError(f"ringattn.attention: {name} is on {t.device} but q is on "
                             f"{q.device}")
    check_documents(document_starts, q, "ringattn.attention")


def window_pair(window, where):
    """(window_left, window_right) of window=(left, right), None or 0 meaning no limit on that
    side. A negative width goes on to the library, which names it."""
    if window is None:
        return 0, 0
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{where}: window is {window!r}; expected a pair (left, right) of "
                        "widths (0 or None: no limit on that side), or None") from None
    pair = []
    for name, width in (("left", left), ("right", right)):
        if width is None:
            pair.append(0)
            continue
        try:
            if isinstance(width, bool):  # an int to Python, and a mistake here
                raise TypeError
            pair.append(operator.index(width))
        except TypeError:
            raise TypeError(f"{where}: window's {name} width is {width!r}; expected an int "
                            "(0 or None: no limit)") from None
    return tuple(pair)


def check_document_tensor(document_starts, where):
    """document_starts is an int64 (or int32) tensor; TypeError naming it otherwise."""
    if not isinstance(document_starts, torch.Tensor):
        raise TypeError(f"{where}: document_starts is a {type(document_starts).__name__}; "
                        "expected an int64 tensor [count] or [batch, count], or None")
    if document_starts.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{where}: document_starts has dtype {document_starts.dtype}; expected "
                        "torch.int64 (or torch.int32, converted)")


def check_documents(document_starts, q, where):
    """document_starts as the C API can describe it: an integer tensor [count] or
    [batch, count] (a batch of 1: one list for every row) on q's device."""
    if document_starts is None:
        return
    check_document_tensor(document_starts, where)
    if document_starts.device != q.device:
        raise ValueError(f"{where}: document_starts is on {document_starts.device} but q is on "
                         f"{q.device}; the library reads them in the tensors' memory")
    batch = q.shape[0] if q.dim() == 4 else None
    if document_starts.dim() not in (1, 2) or (
            document_starts.dim() == 2 and batch is not None
            and document_starts.shape[0] not in (1, batch)):
        raise ValueError(f"{where}: document_starts has shape {list(document_starts.shape)}; "
                         f"expected [count] or [batch, count] with batch {batch} (or 1)")


def documents_for_c(document_starts):
    """document_starts as the C API reads them: int64, unit stride along count, [count] (one
    list) or [batch, count]."""
    if document_starts is None:
        return None
    t = document_starts.to(torch.int64)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _viewable(t):
    """t itself when the C API can read it as a view, else a contiguous copy. The C API needs
    unit stride along head_dim and strides >= 1 elsewhere (no broadcast axes); the CUDA block
    also needs strides that are multiples of 8 elements and 16-byte aligned data."""
    if t.is_contiguous() and (not t.is_cuda or (t.shape[-1] % 8 == 0 and t.data_ptr() % 16 == 0)):
        return t  # every outer stride a multiple of head_dim
    outer = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1]  # axes other than head_dim
    ok = (t.shape[-1] <= 1 or t.stride(-1) == 1) and all(s >= 1 for s in outer)
    if ok and t.is_cuda:
        ok = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in outer)
    return t if ok else t.contiguous()


# torch's current raw stream of a device index, without the Stream object that
# torch.cuda.current_stream builds (None where this torch lacks it).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_NO_DEVICE_CHANGE = contextlib.nullcontext()
_CONTIGUOUS = torch.contiguous_format


def _stream(t):
    """The current stream of the tensor's device: the library's calls queue behind torch's work."""
    if not t.is_cuda:
        return None
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _device(t):
    """A context in which the tensor's device is current (the library launches on the current
    device): nothing to do for CPU tensors and where it already is, torch.cuda.device otherwise."""
    if not t.is_cuda or (_current_device is not None and _current_device() == t.get_device()):
        return _NO_DEVICE_CHANGE
    return torch.cuda.device(t.device)


def _forward_impl(q, k, v, document_starts, causal, scale, q_start, k_start, window_left,
                  window_right, deterministic):
    """O [B, Sq, Hq, Dv] in q's dtype and LSE [B, Hq, Sq] in the accumulator dtype.
    deterministic is the backward's (kept with the forward's arguments for it)."""
    _check(q, k, v, document_starts)
    lib = _capi.library()
    q, k, v = _viewable(q), _viewable(k), _viewable(v)
    documents = documents_for_c(document_starts)
    batch, q_len, q_heads, _ = q.shape
    o = torch.empty(batch, q_len, q_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=_accumulator_dtype(q.dtype), device=q.device)
    params = _forward_params(q, k, v, o, lse, documents, causal, scale, q_start, k_start,
                             window_left, window_right)
    with _device(q):
        lib.forward(params, _stream(q))
    return o, lse


def _inputs_key(q, k, v):
    """The part of a call shape's template key (_capi.Packed.pack_cached) that q, k and v make."""
    return (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(),
            v.dtype, q.is_cuda)


def _forward_params(q, k, v, o, lse, documents, causal, scale, q_start, k_start, window_left,
                    window_right):
    """The forward's parameter struct as bytes, for o and lse as _forward_impl allocates them
    (which follow from q's and v's shapes and q's dtype): from the call shape's template where
    there are no documents (whose pointer is not a tensor field's), else packed in full."""
    values = _capi.tensor_values

    def fields():
        return (*values(q), *values(k), *values(v), *values(o), *values(lse), scale, int(causal),
                0, q_start, k_start, *_capi.mask_values(window_left, window_right, documents))

    if documents is not None:
        return _capi.FORWARD.pack(*fields())
    return _capi.FORWARD.pack_cached(
        (*_inputs_key(q, k, v), scale, causal, q_start, k_start, window_left, window_right),
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()), fields)


@torch.library.custom_op("ringattn::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, document_starts: Optional[Tensor],
                      causal: bool, scale: float, q_start: int, k_start: int, window_left: int,
                      window_right: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    """O [B, Sq, Hq, Dv] in q's dtype and LSE [B, Hq, Sq] in the accumulator dtype.
    deterministic is the backward's (kept with the forward's arguments for it)."""
    return _forward_impl(q, k, v, document_starts, causal, scale, q_start, k_start, window_left,
                         window_right, deterministic)


@attention_forward.register_fake
def _(q, k, v, document_starts, causal, scale, q_start, k_start, window_left, window_right,
      deterministic):
    _check(q, k, v, document_starts)
    batch, q_len, q_heads, _ = q.shape
    o = q.new_empty(batch, q_len, q_heads, v.shape[-1])
    lse = q.new_empty(batch, q_heads, q_len, dtype=_accumulator_dtype(q.dtype))
    return o, lse


def _backward_impl(dout, dlse, q, k, v, o, lse, document_starts, causal, scale, q_start,
                   k_start, window_left, window_right, deterministic):
    """dQ, dK, dV in the inputs' dtype from the forward's saved O and LSE (P is recomputed from
    the LSE, which is not), under the forward's mask. dout (of O) and dlse (of LSE) may be None:
    no gradient reached them."""
    _check(q, k, v, document_starts)
    lib = _capi.library()
    q, k, v, o = _viewable(q), _viewable(k), _viewable(v), _viewable(o)
    documents = documents_for_c(document_starts)
    dout = torch.zeros_like(o) if dout is None else _viewable(dout)
    acc = _accumulator_dtype(q.dtype)
    # delta = rowsum(dO * O), a fresh buffer [B, Hq, Sq] of the accumulator dtype. The backward
    # forms dS = P * (dP - delta); a gradient g of LSE adds P * g (dLSE/dS = P), so it enters as
    # delta - g. Rows that see no key have P = 0 and take neither.
    # (Each buffer contiguous, by empty_like: torch.empty of a torch.Size takes twice its host
    # time.)
    delta = torch.empty_like(lse, dtype=acc, memory_format=_CONTIGUOUS)
    # The C API adds into dq (accumulator dtype), which the prepare pass sets to zero; dk and dv
    # it writes (overwrite_key_gradients), rounded once to the inputs' dtype.
    dq = torch.empty_like(q, dtype=acc, memory_format=_CONTIGUOUS)
    dk = torch.empty_like(k, memory_format=_CONTIGUOUS)
    dv = torch.empty_like(v, memory_format=_CONTIGUOUS)
    stream = _stream(q)
    values, packed = _capi.tensor_values, _capi.tensor_bytes
    dout_v, delta_v, dq_v = values(dout), values(delta), values(dq)  # in both calls
    with _device(q):
        lib.backward_prepare(packed(o), packed(dout, dout_v), packed(delta, delta_v), stream,
                             dq=packed(dq, dq_v))
        if dlse is not None:
            delta.sub_(dlse.to(acc))
        lse = _viewable(lse)

        def fields():
            return (*values(q), *values(k), *values(v), *dout_v, *values(lse), *delta_v, *dq_v,
                    *values(dk), *values(dv), scale, int(causal), int(deterministic), q_start,
                    k_start, 1,  # overwrite_key_gradients
                    *_capi.NO_TENSOR, *_capi.NO_TENSOR,  # no key rotation
                    *_capi.mask_values(window_left, window_right, documents))

        if documents is None:  # delta, dq, dk and dv follow from lse's, q's, k's and v's shapes
            params = _capi.BACKWARD.pack_cached(
                (*_inputs_key(q, k, v), dout_v[1:], lse.shape, lse.stride(), lse.dtype, scale,
                 causal, deterministic, q_start, k_start, window_left, window_right),
                (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout_v[0], lse.data_ptr(),
                 delta_v[0], dq_v[0], dk.data_ptr(), dv.data_ptr(), 0, 0), fields)
        else:
            params = _capi.BACKWARD.pack(*fields())
        lib.backward(params, stream)
    return dq.to(q.dtype), dk, dv


@torch.library.custom_op("ringattn::attention_backward", mutates_args=())
def attention_backward(dout: Optional[Tensor], dlse: Optional[Tensor], q: Tensor, k: Tensor,
                       v: Tensor, o: Tensor, lse: Tensor, document_starts: Optional[Tensor],
                       causal: bool, scale: float, q_start: int, k_start: int, window_left: int,
                       window_right: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV in the inputs' dtype from the forward's saved O and LSE (P is recomputed from
    the LSE, which is not), under the forward's mask. dout (of O) and dlse (of LSE) may be None:
    no gradient reached them."""
    return _backward_impl(dout, dlse, q, k, v, o, lse, document_starts, causal, scale, q_start,
                          k_start, window_left, window_right, deterministic)


@attention_backward.register_fake
def _(dout, dlse, q, k, v, o, lse, document_starts, causal, scale, q_start, k_start, window_left,
      window_right, deterministic):
    _check(q, k, v, document_starts)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, document_starts = inputs[:4]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, document_starts)
    ctx.args = inputs[4:]


def _backward(ctx, dout, dlse):
    q, k, v, o, lse, document_starts = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, dlse, q, k, v, o, lse, document_starts, *ctx.args)
    return (dq, dk, dv, None) + (None,) * len(ctx.args)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' two implementations as one autograd node, for eager calls (see
    eager_attention). Gradients that did not reach O or LSE arrive as None. The scalar arguments
    come as one tuple: apply's host time grows with its argument count."""

    @staticmethod
    def forward(ctx, q, k, v, document_starts, args):
        ctx.set_materialize_grads(False)
        o, lse = _forward_impl(q, k, v, document_starts, *args)
        ctx.save_for_backward(q, k, v, o, lse, document_starts)
        ctx.args = args
        return o, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, o, lse, document_starts = ctx.saved_tensors
        dq, dk, dv = _backward_impl(dout, dlse, q, k, v, o, lse, document_starts, *ctx.args)
        return dq, dk, dv, None, None


def _functorch_active():
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is None or active()


def plain_eager(q, k, v):
    """Whether a call is plain eager on real tensors: not under torch.compile or a torch.func
    transform, exact torch.Tensor inputs (no fake, meta or subclass tensors) on CPU or CUDA. Such
    a call may skip the custom op's dispatch for one autograd.Function of the same code."""
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()
            and not _functorch_active())


def eager_attention(q, k, v, document_starts, *args):
    """(O, LSE) of attention_forward's arguments: where the call is plain eager (plain_eager),
    through _EagerAttention, or straight to the forward when no input needs a gradient (what the
    Function would return too: outputs outside any graph); else through the custom op, which
    handles the rest."""
    if plain_eager(q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _EagerAttention.apply(q, k, v, document_starts, args)
        return _forward_impl(q, k, v, document_starts, *args)  # no graph to record
    return attention_forward(q, k, v, document_starts, *args)
