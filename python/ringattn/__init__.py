"""ringattn from PyTorch: the local attention block of the C API as a differentiable torch op,
and ring attention over the ranks of an mpi4py communicator.

    import ringattn
    o = ringattn.attention(q, k, v, causal=True)    # [batch, seq, heads, head_dim]
    o = ringattn.attention(q, k, v, causal=True, window=(4096, None),
                           document_starts=starts)  # a sliding window within packed documents

    ring = ringattn.RingAttention(MPI.COMM_WORLD, layout="zigzag")
    o = ring(q, k, v, causal=True)                  # this rank's shards [batch, seq/N, ...]

    ring = ringattn.RingAttention(MPI.COMM_WORLD, layout="balanced")  # follows each call's mask
    q = ring.shard(q_whole, causal=True, document_starts=starts)
    o = ring(q, k, v, causal=True, document_starts=starts)

See docs/python.md.
"""
import sys

from ringattn._capi import RingattnError, find_library, library
from ringattn._modules import Attention, register_transformers
from ringattn._layout import positions, shard, unshard
from ringattn._ops import attention_backward, attention_forward
from ringattn._ops import check_documents as _check_documents
from ringattn._ops import check_tensors as _check_tensors
from ringattn._ops import default_scale as _default_scale
from ringattn._ops import eager_attention as _eager_attention
from ringattn._ops import window_pair as _window_pair
from ringattn._ring import RingAttention
from ringattn._version import __version__

__all__ = ["Attention", "RingAttention", "RingattnError", "__version__", "attention",
           "find_library", "library", "library_version", "positions", "register_transformers",
           "shard", "unshard"]

# attn_implementation="ringattn" where transformers is already loaded; otherwise
# ringattn.register_transformers() registers it (importing transformers takes seconds).
if "transformers" in sys.modules:
    register_transformers()


def library_version():
    """The version string of the shared library in use (found and loaded on first call)."""
    return library().version


def attention(q, k, v, *, causal=False, scale=None, q_start=0, k_start=0, window=None,
              document_starts=None, return_lse=False, deterministic=False):
    """softmax(q k^T * scale + mask) v, by ringattn's local block.

    q [batch, q_len, q_heads, head_dim], k [batch, k_len, kv_heads, head_dim] and
    v [batch, k_len, kv_heads, v_head_dim] with q_heads a multiple of kv_heads (GQA). CPU tensors
    of f32 or f64 (any head dims; v_head_dim may differ from head_dim) or CUDA tensors of bf16 or
    f16 (the head dims the library was built for, v_head_dim equal to head_dim, or 192 with
    v_head_dim 128), on the current stream. Any strides; a tensor without unit stride along its last axis (or, on CUDA, with
    strides the kernels cannot take) is copied to a contiguous one first.

    The mask is by global position: query row i sits at q_start + i, key row j at k_start + j,
    and the query at position p sees the key at position r when every term given holds:
      causal                          r <= p
      window=(left, right)            p - r < left and r - p < right (0 or None: no limit on
                                      that side; (1, None) with causal: only itself)
      document_starts                 p and r lie in the same document
    document_starts: an int64 (or int32) tensor on q's device, [count] for every batch row or
    [batch, count] for each, of the documents' global start positions in non-decreasing order
    (cu_seqlens works as it is: the document of a position is the number of starts at or before
    it). A row that sees no key gets O = 0, LSE = -inf and zero gradients.
    scale defaults to 1 / sqrt(head_dim).

    Returns O [batch, q_len, q_heads, v_head_dim] in q's dtype, and with return_lse also
    LSE [batch, q_heads, q_len] (log-sum-exp of each row's scaled scores) in the accumulator dtype
    (f64 for f64 inputs, f32 otherwise). Both are differentiable; the backward recomputes P from
    the saved LSE under the same mask. deterministic asks the CUDA backward for
    bitwise-reproducible gradients (the CPU one always is). Failures of the library raise
    RingattnError with its message.
    """
    _check_tensors(q, k, v, "ringattn.attention")
    if scale is None:
        scale = _default_scale(q)
    window_left, window_right = _window_pair(window, "ringattn.attention")
    _check_documents(document_starts, q, "ringattn.attention")  # before the op's own schema
    o, lse = _eager_attention(q, k, v, document_starts, bool(causal), float(scale), int(q_start),
                              int(k_start), window_left, window_right, bool(deterministic))
    return (o, lse) if return_lse else o
