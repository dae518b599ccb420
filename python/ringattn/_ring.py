"""Ring attention over the ranks of an mpi4py communicator or a torch.distributed group,
through the C API's ring (ringattn_ring_create or ringattn_ring_create_nccl, _forward, _backward,
_destroy).

The forward and backward are the custom ops ringattn::ring_forward and ringattn::ring_backward:
a ring handle is no tensor, so the ops take the ring's id, an int, and look the ring up in a
registry of the live ones. Each op has a fake implementation, so torch.compile traces through a
ring call as one opaque node, like ringattn.attention's. A plain eager call skips the ops'
dispatch: _EagerRing runs the same two implementations as one autograd node.

Every ring call is collective. A failure the library finds (a bad shape on any rank, ranks that
disagree) is agreed between the ranks before any transfer, so every rank raises the same
RingattnError; the few checks made here before the library is reached (a closed ring, a tensor
the C API cannot describe) are local, and a rank failing one of them alone leaves the others
waiting in the call.
"""
import atexit
import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor

from ringattn import _capi
from ringattn._capi import RingattnError
from ringattn._layout import check_layout, positions, shard, unshard
from ringattn._ops import (_accumulator_dtype, _device, _stream, _viewable, check_documents,
                           check_tensors, default_scale, documents_for_c, plain_eager,
                           window_pair)

DEVICES = {"cpu": _capi.HOST, "cuda": _capi.DEVICE}

# id -> weakref to the RingAttention: the ops find their ring by id, and a ring no one holds is
# destroyed with its object.
_rings = {}
_ids = itertools.count(1)


def _close_all():
    """At exit, before mpi4py finalises MPI (it does so after every atexit handler): the rings
    still open free their communicators while MPI can."""
    for ref in list(_rings.values()):
        ring = ref()
        if ring is not None:
            ring.close()


atexit.register(_close_all)


def _process_group(comm):
    """comm as a torch.distributed ProcessGroup, or None when it is none (an mpi4py
    communicator, or anything else, which the MPI branch refuses by name)."""
    import torch.distributed as dist
    if not dist.is_available() or not isinstance(comm, dist.ProcessGroup):
        return None
    if not dist.is_initialized():
        raise ValueError("ringattn.RingAttention: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group first")
    return comm


def _nccl_ring_place(group):
    """This process's rank in the group and the group's size."""
    import torch.distributed as dist
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("ringattn.RingAttention: this process is not a member of the group")
    return rank, dist.get_world_size(group)


def _shared_nccl_id(lib, group):
    """The NCCL unique id of the group's first rank, on every rank of the group (collective)."""
    import torch.distributed as dist
    made = [lib.nccl_unique_id() if dist.get_rank(group) == 0 else None]
    # broadcast_object_list pickles through a tensor on the current CUDA device for NCCL groups
    # and on the CPU for gloo; its src is a global rank.
    dist.broadcast_object_list(made, src=dist.get_global_rank(group, 0), group=group)
    unique_id = made[0]
    if not isinstance(unique_id, bytes) or len(unique_id) != _capi.NCCL_UNIQUE_ID_BYTES:
        raise RingattnError(f"ringattn.RingAttention: the group's first rank sent no NCCL unique "
                            f"id ({type(unique_id).__name__})")
    return unique_id


class RingAttention:
    """Ring attention over the ranks of an mpi4py communicator or a torch.distributed group.

        from mpi4py import MPI
        ring = ringattn.RingAttention(MPI.COMM_WORLD, layout="zigzag")
        o = ring(q, k, v, causal=True)      # this rank's shards [batch, S/N, heads, head_dim]

        torch.distributed.init_process_group("nccl")      # under torchrun
        torch.cuda.set_device(local_rank)
        ring = ringattn.RingAttention(torch.distributed.group.WORLD)

    layout: how the S tokens are split over the N ranks ("zigzag": rank r holds chunks r and
    2N-1-r of 2N; "contiguous": tokens [r S/N, (r+1) S/N); "balanced": chunks that even out the
    ranks' visible work under each call's mask, so that every call takes its layout from its own
    causal, window and document_starts); shard(), unshard() and positions() follow it (for
    "balanced", given the calls' mask). The ranks and their order are the communicator's or the
    group's.

    From an mpi4py communicator, device "cpu" (the default): f32 or f64 CPU tensors over MPI;
    "cuda": bf16 or f16 CUDA tensors over NCCL, each rank on the GPU of its node-local rank. The
    library duplicates comm, so comm may be freed afterwards.

    From a torch.distributed ProcessGroup (any backend: it only carries the NCCL unique id that the
    group's first rank makes, once): bf16 or f16 CUDA tensors over NCCL, each rank on its current
    CUDA device (torch.cuda.set_device); the ring makes no MPI call.

    Creating the ring is collective over the ranks; so are its calls and close(). The ring is
    destroyed by close(), by leaving a `with` block, when the object is collected, or at exit.
    """

    def __init__(self, comm, layout="zigzag", device=None):
        self._handle, self.ring_id = None, None  # what close() and repr() read, set first
        check_layout(layout, "ringattn.RingAttention")
        group = _process_group(comm)
        if device is None:
            device = "cuda" if group is not None else "cpu"
        device = torch.device(device).type
        if device not in DEVICES:
            raise ValueError(f"ringattn.RingAttention: device is {device!r}; expected 'cpu' "
                             "(f32, f64 over MPI) or 'cuda' (bf16, f16 over NCCL)")
        self.layout = layout
        self.device = device
        self._lib = _capi.library()
        if group is not None:
            if device != "cuda":
                raise ValueError("ringattn.RingAttention: a ring from a torch.distributed group "
                                 "moves CUDA tensors over NCCL (device 'cuda'); for CPU tensors, "
                                 "make the ring from an mpi4py communicator")
            self.rank, self.size = _nccl_ring_place(group)
            self._handle = self._lib.ring_create_nccl(_shared_nccl_id(self._lib, group),
                                                      self.rank, self.size,
                                                      _capi.LAYOUT_CODES[layout])
        else:
            from mpi4py import MPI
            if not isinstance(comm, MPI.Comm):
                raise TypeError(f"ringattn.RingAttention: comm is a {type(comm).__name__}; "
                                "expected an mpi4py communicator (e.g. MPI.COMM_WORLD) or a "
                                "torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD)")
            if comm == MPI.COMM_NULL:
                raise ValueError("ringattn.RingAttention: comm is MPI.COMM_NULL")
            if comm.Is_inter():
                raise ValueError("ringattn.RingAttention: comm is an intercommunicator; expected "
                                 "an intracommunicator")
            self.rank = comm.Get_rank()
            self.size = comm.Get_size()
            # ringattn_ring_create reads an MPI_Comm through the pointer: the address of the
            # handle inside the mpi4py object.
            self._handle = self._lib.ring_create(MPI._addressof(comm), DEVICES[device],
                                                 _capi.LAYOUT_CODES[layout])
        self.ring_id = next(_ids)
        _rings[self.ring_id] = weakref.ref(self)

    def __call__(self, q, k, v, causal=False, scale=None, return_lse=False, *, window=None,
                 document_starts=None, deterministic=False):
        """softmax(q k^T * scale + mask) v over the whole sequence, for this rank's queries.

        q [batch, S/N, q_heads, head_dim], k [batch, S/N, kv_heads, head_dim] and
        v [batch, S/N, kv_heads, v_head_dim]: this rank's shards (shard()), q_heads a multiple of
        kv_heads, v_head_dim free on the CPU. The mask is by global position in the whole
        sequence, whichever ranks hold the keys: causal, window=(left, right) and
        document_starts as in ringattn.attention, where document_starts ([count] or
        [batch, count], on the tensors' device) lists the documents of the whole sequence, the
        same on every rank. scale defaults to 1 / sqrt(head_dim). Returns this rank's
        O [batch, S/N, q_heads, v_head_dim] in q's dtype, and with return_lse its
        LSE [batch, q_heads, S/N] in the accumulator dtype (f64 for f64, f32 otherwise). Both are
        differentiable (on CUDA, O only); the backward is collective like the forward, under the
        same mask. deterministic asks the CUDA backward for bitwise-reproducible gradients.
        """
        check_tensors(q, k, v, "ringattn.RingAttention")
        if scale is None:
            scale = default_scale(q)
        window_left, window_right = window_pair(window, "ringattn.RingAttention")
        check_documents(document_starts, q, "ringattn.RingAttention")  # before the op's schema
        args = (self.ring_id, bool(causal), float(scale), window_left, window_right,
                bool(return_lse), bool(deterministic))
        if plain_eager(q, k, v):
            o, lse = _EagerRing.apply(q, k, v, document_starts, *args)
        else:
            o, lse = ring_forward(q, k, v, document_starts, *args)
        return (o, lse) if return_lse else o

    def positions(self, seq_len, *, causal=None, window=None, document_starts=None, device=None):
        """This rank's global token positions in a sequence of seq_len tokens. A balanced ring
        needs the mask of its calls (causal given, True or False; window and document_starts as
        the calls take them); the other layouts ignore it."""
        return positions(seq_len, self.rank, self.size, self.layout, causal=causal, window=window,
                         document_starts=document_starts, device=device)

    def shard(self, x, dim=1, *, causal=None, window=None, document_starts=None):
        """This rank's tokens of the whole sequence x (the mask as in positions())."""
        return shard(x, self.rank, self.size, self.layout, dim, causal=causal, window=window,
                     document_starts=document_starts)

    def unshard(self, shards_or_gathered, dim=1, *, causal=None, window=None,
                document_starts=None):
        """The whole sequence from every rank's shard, in rank order (the mask as in
        positions())."""
        return unshard(shards_or_gathered, self.size, self.layout, dim, causal=causal,
                       window=window, document_starts=document_starts)

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """Destroys the ring (collective, like its calls); later calls raise RingattnError."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        _rings.pop(self.ring_id, None)
        self._lib.ring_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # a destructor must not raise; the library has said why on stderr
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"rank {self.rank} of {self.size}"
        return (f"RingAttention(layout={self.layout!r}, device={self.device!r}, {state}, "
                f"ring_id={self.ring_id})")


def _ring(ring_id):
    """The open RingAttention of that id."""
    ref = _rings.get(ring_id)
    ring = ref() if ref is not None else None
    if ring is None or ring.closed:
        raise RingattnError(f"ringattn ring {ring_id} is closed: keep its RingAttention open "
                            "until the last forward and backward through it have run")
    return ring


def _check_describable(q, k, v, document_starts, where):
    """What the C API's descriptors need; every other check is the library's, agreed between
    the ranks."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() > 4:
            raise ValueError(f"{where}: {name} has shape {list(t.shape)}; expected rank 4 "
                             "[batch, seq, heads, head_dim]")
        if t.dtype not in _capi.DTYPE_CODES:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; expected torch.float32 or "
                            "torch.float64 (CPU), torch.bfloat16 or torch.float16 (CUDA)")
    check_documents(document_starts, q, where)


def _output_shapes(q, v):
    """O's and LSE's shapes; empty ones where q or v is not rank 4, which the library then
    names (on every rank) rather than this rank alone."""
    if q.dim() != 4 or v.dim() != 4:
        return (0, 0, 0, 0), (0, 0, 0)
    batch, local_len, q_heads, _ = q.shape
    return (batch, local_len, q_heads, v.shape[-1]), (batch, q_heads, local_len)


def _ring_forward_impl(q, k, v, document_starts, ring_id, causal, scale, window_left,
                       window_right, lse_grad, deterministic):
    """This rank's O [B, Sl, Hq, Dv] in q's dtype and LSE [B, Hq, Sl] in the accumulator dtype.
    lse_grad and deterministic are the backward's (kept with the forward's arguments for it)."""
    ring = _ring(ring_id)
    _check_describable(q, k, v, document_starts, "ringattn.RingAttention")
    q, k, v = _viewable(q), _viewable(k), _viewable(v)
    documents = documents_for_c(document_starts)
    o_shape, lse_shape = _output_shapes(q, v)
    o = torch.empty(o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    values = _capi.tensor_values
    params = _capi.RING_FORWARD.pack(*values(q), *values(k), *values(v), *values(o),
                                     *values(lse), scale, int(causal),
                                     *_capi.mask_values(window_left, window_right, documents))
    with _device(q):
        ring._lib.ring_forward(ring._handle, params, _stream(q))
    return o, lse


@torch.library.custom_op("ringattn::ring_forward", mutates_args=())
def ring_forward(q: Tensor, k: Tensor, v: Tensor, document_starts: Optional[Tensor],
                 ring_id: int, causal: bool, scale: float, window_left: int, window_right: int,
                 lse_grad: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    """This rank's O [B, Sl, Hq, Dv] in q's dtype and LSE [B, Hq, Sl] in the accumulator dtype."""
    return _ring_forward_impl(q, k, v, document_starts, ring_id, causal, scale, window_left,
                              window_right, lse_grad, deterministic)


@ring_forward.register_fake
def _(q, k, v, document_starts, ring_id, causal, scale, window_left, window_right, lse_grad,
      deterministic):
    _check_describable(q, k, v, document_starts, "ringattn.RingAttention")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ringattn.RingAttention: q and v have shapes {list(q.shape)} and "
                         f"{list(v.shape)}; expected rank 4 [batch, seq, heads, head_dim]")
    o_shape, lse_shape = _output_shapes(q, v)
    return q.new_empty(o_shape), q.new_empty(lse_shape, dtype=_accumulator_dtype(q.dtype))


def _with_lse_gradient(v, o, dout, dlse):
    """v, o and dout with one column more, through which the ring's backward takes the gradient
    g of the LSE. The C API's ring backward forms delta = rowsum(dO * O) itself, and
    dS = P * (dP - delta); a gradient of the LSE needs dS = P * (dP - delta + g) (dLSE/dS = P).
    With a zero column on V (dP and the other columns of dV unchanged), -g on O and 1 on dO, the
    delta it forms is delta - g. dV's extra column (P^T 1) is dropped afterwards."""
    ones = dout.new_ones(*dout.shape[:-1], 1)
    minus_g = (-dlse).transpose(1, 2).unsqueeze(-1).to(o.dtype)  # [B, Hq, Sl] -> [B, Sl, Hq, 1]
    return (torch.cat([v, v.new_zeros(*v.shape[:-1], 1)], -1), torch.cat([o, minus_g], -1),
            torch.cat([dout, ones], -1))


def _ring_backward_impl(dout, dlse, q, k, v, o, lse, document_starts, ring_id, causal, scale,
                        window_left, window_right, lse_grad, deterministic):
    """dQ, dK, dV of this rank's shards, in the inputs' dtype, from the forward's saved O and
    LSE. dout (of O) and dlse (of LSE) may be None: no gradient reached them. With lse_grad (the
    forward's return_lse) the CPU ring takes dlse through an extra column (_with_lse_gradient),
    decided by the argument rather than by dlse, so every rank calls the ring alike."""
    ring = _ring(ring_id)
    _check_describable(q, k, v, document_starts, "ringattn.RingAttention backward")
    acc = _accumulator_dtype(q.dtype)
    q, k, v, o = _viewable(q), _viewable(k), _viewable(v), _viewable(o)
    documents = documents_for_c(document_starts)
    dout = torch.zeros_like(o) if dout is None else _viewable(dout)
    extra_column = lse_grad and not q.is_cuda
    if extra_column:
        dlse = torch.zeros_like(lse) if dlse is None else dlse.to(acc)
        v, o, dout = _with_lse_gradient(v, o, dout, dlse)
    elif lse_grad and dlse is not None and bool(dlse.any()):
        raise NotImplementedError(
            "ringattn.RingAttention: the LSE of a ring on CUDA tensors is not differentiable "
            "(the C API's ring backward takes no LSE gradient, and the CPU ring's extra value "
            "column has no CUDA kernel); use O only, or detach the LSE")
    # The ring overwrites dq, dk and dv, in the accumulator dtype.
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    values = _capi.tensor_values
    params = _capi.RING_BACKWARD.pack(
        *values(q), *values(k), *values(v), *values(o), *values(_viewable(lse)), *values(dout),
        *values(dq), *values(dk), *values(dv), scale, int(causal), int(deterministic),
        *_capi.mask_values(window_left, window_right, documents))
    with _device(q):
        ring._lib.ring_backward(ring._handle, params, _stream(q))
    if extra_column:
        dv = dv[..., :-1].contiguous()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("ringattn::ring_backward", mutates_args=())
def ring_backward(dout: Optional[Tensor], dlse: Optional[Tensor], q: Tensor, k: Tensor,
                  v: Tensor, o: Tensor, lse: Tensor, document_starts: Optional[Tensor],
                  ring_id: int, causal: bool, scale: float, window_left: int, window_right: int,
                  lse_grad: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of this rank's shards, in the inputs' dtype (_ring_backward_impl)."""
    return _ring_backward_impl(dout, dlse, q, k, v, o, lse, document_starts, ring_id, causal,
                               scale, window_left, window_right, lse_grad, deterministic)


@ring_backward.register_fake
def _(dout, dlse, q, k, v, o, lse, document_starts, ring_id, causal, scale, window_left,
      window_right, lse_grad, deterministic):
    _check_describable(q, k, v, document_starts, "ringattn.RingAttention backward")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, document_starts, ring_id = inputs[:5]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, document_starts)
    ctx.args = inputs[4:]
    # The graph holds its ring: a RingAttention dropped between forward and backward stays open
    # until the backward has run (close() still closes it).
    ref = _rings.get(ring_id) if isinstance(ring_id, int) else None
    ctx.ring = ref() if ref is not None else None


def _backward(ctx, dout, dlse):
    q, k, v, o, lse, document_starts = ctx.saved_tensors
    dq, dk, dv = ring_backward(dout, dlse, q, k, v, o, lse, document_starts, *ctx.args)
    return (dq, dk, dv, None) + (None,) * len(ctx.args)


ring_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerRing(torch.autograd.Function):
    """The ring's two implementations as one autograd node, for plain eager calls (plain_eager).
    Gradients that did not reach O or LSE arrive as None; the node holds its ring open until the
    backward has run, like the custom op's."""

    @staticmethod
    def forward(ctx, q, k, v, document_starts, ring_id, *args):
        ctx.set_materialize_grads(False)
        o, lse = _ring_forward_impl(q, k, v, document_starts, ring_id, *args)
        ctx.save_for_backward(q, k, v, o, lse, document_starts)
        ctx.args = (ring_id,) + args
        ctx.ring = _ring(ring_id)
        return o, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, o, lse, document_starts = ctx.saved_tensors
        dq, dk, dv = _ring_backward_impl(dout, dlse, q, k, v, o, lse, document_starts, *ctx.args)
        return (dq, dk, dv, None) + (None,) * len(ctx.args)
