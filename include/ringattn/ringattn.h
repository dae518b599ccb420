/* ringattn C API: the local attention block for any language (C, C++, Python ctypes, Rust).
 *
 * Tensors are described by ringattn_tensor_t: a pointer, a dtype, where the memory lives, and up
 * to four extents and strides in elements. Layouts:
 *   q, dq            [batch, q_len, q_heads, head_dim]
 *   k, dk            [batch, k_len, kv_heads, head_dim]      q_heads % kv_heads == 0
 *   v, dv            [batch, k_len, kv_heads, v_head_dim]
 *   o, dout          [batch, q_len, q_heads, v_head_dim]
 *   lse, delta       [batch, q_heads, q_len]                  accumulator dtype
 * v_head_dim (d_v) is read from v's descriptor and may differ from head_dim (d_qk, q's and k's),
 * as in multi-head latent attention (192/128); the usual scale is 1/sqrt(head_dim). The
 * accumulator dtype is f64 for f64 inputs and f32 otherwise. Host tensors (f32 or f64, any
 * head_dim and v_head_dim) run on the CPU flash block, device tensors (f16 or bf16, head_dim 32,
 * 64, 96, 128, 192 or 256 as the build has them, v_head_dim equal to it, or head_dim 192 with
 * v_head_dim 128) on the CUDA one; a device call of other head dims returns
 * RINGATTN_ERROR_UNSUPPORTED, naming them, before any CUDA call. See ringattn/attention.hpp for the
 * full contract (combine mode, add-into gradients, masks by global position).
 *
 * Masks are by global position: query row i sits at position q_start + i, key row j at
 * k_start + j (a ring passes each shard's positions itself), and the query at position i sees the
 * key at position j when every term that is set holds:
 *   causal          j <= i
 *   window_left     i - j < window_left    (0: no limit; 1 with causal: the query's own key only)
 *   window_right    j - i < window_right   (0: no limit; it changes nothing under causal)
 *   documents       i and j lie in the same document
 * Documents are packed sequences given by their global start positions (cu_seqlens style; a final
 * end may be included or left out): document_starts[b * document_batch_stride + n],
 * n < num_documents, non-decreasing along n, and the document of position p is the number of
 * starts <= p. Positions before the first start form document 0; a start repeated, or at or past
 * the sequence's end, makes an empty document (the padding of a batch row with fewer documents).
 * document_batch_stride 0 gives every batch row the same list. The list lives in the memory of the
 * tensors (device memory for device tensors, read by the kernels) and covers the whole sequence,
 * not one chunk of it. All zero (num_documents 0, document_starts may be NULL): no window and one
 * document, the behaviour of 0.3. A row that sees no key gets O = 0 and LSE = -inf, and its query
 * and the keys nobody sees get zero gradients.
 *
 * Every call returns a status; on failure ringattn_last_error() gives a message naming the
 * argument, its value and what was expected. Parameter structs start with struct_size, which the
 * caller sets to sizeof(the struct): later versions append fields without breaking callers. The
 * library takes the sizeof of its own struct or of any older version's (the fields an older
 * struct ends before keep their defaults) and refuses any other size, naming the sizes it takes.
 */
#ifndef RINGATTN_RINGATTN_H
#define RINGATTN_RINGATTN_H

#include <stddef.h>
#include <stdint.h>

#include "ringattn/config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ringattn_status {
  RINGATTN_SUCCESS = 0,
  RINGATTN_ERROR_INVALID_ARGUMENT = 1, /* a shape, dtype, stride, pointer or value it cannot take */
  RINGATTN_ERROR_UNSUPPORTED = 2,      /* not built or not available here (head_dim, GPU, CUDA) */
  RINGATTN_ERROR_LIBRARY = 3,          /* a CUDA, NCCL, MPI or HDF5 call failed */
  RINGATTN_ERROR_IO = 4,               /* a file is missing, unreadable or corrupt */
  RINGATTN_ERROR_INTERNAL = 5          /* anything else (out of host memory, a bug) */
} ringattn_status_t;

typedef enum ringattn_dtype {
  RINGATTN_F32 = 0,
  RINGATTN_F64 = 1,
  RINGATTN_F16 = 2,
  RINGATTN_BF16 = 3
} ringattn_dtype_t;

typedef enum ringattn_memory { RINGATTN_HOST = 0, RINGATTN_DEVICE = 1 } ringattn_memory_t;

typedef struct ringattn_tensor {
  void* data;
  int32_t dtype;  /* ringattn_dtype_t */
  int32_t memory; /* ringattn_memory_t */
  int32_t rank;   /* 3 or 4 (2 for the key rotation's tables) */
  int64_t shape[4];
  int64_t strides[4]; /* elements, not bytes */
} ringattn_tensor_t;

typedef struct ringattn_forward_params {
  size_t struct_size; /* sizeof(ringattn_forward_params_t) */
  ringattn_tensor_t q, k, v;
  ringattn_tensor_t o;   /* input dtype, or the running accumulator when combine != 0 */
  ringattn_tensor_t lse; /* accumulator dtype */
  double scale;          /* > 0, usually 1/sqrt(head_dim) (q's, whatever v's) */
  int32_t causal;        /* query at global position i sees keys at positions <= i */
  int32_t combine;       /* merge into a running (o, lse) pair instead of overwriting */
  int64_t q_start;       /* global position of the first query row */
  int64_t k_start;       /* global position of the first key row */
  /* Since 0.4: the sliding window and the documents of the mask (above); a struct_size that ends
   * before them (0.1 to 0.3) means no window and one document. */
  int64_t window_left, window_right;     /* >= 0; 0: no limit */
  const int64_t* document_starts;        /* [batch, num_documents], in q's memory */
  int64_t num_documents;                 /* >= 0; 0: one document */
  int64_t document_batch_stride;         /* elements between batch rows' lists; 0: one list */
} ringattn_forward_params_t;

typedef struct ringattn_backward_params {
  size_t struct_size; /* sizeof(ringattn_backward_params_t) */
  ringattn_tensor_t q, k, v, dout;
  ringattn_tensor_t lse;        /* final LSE of the forward */
  ringattn_tensor_t delta;      /* from ringattn_attention_backward_prepare */
  ringattn_tensor_t dq, dk, dv; /* accumulator dtype; gradients are added into them */
  double scale;
  int32_t causal;
  int32_t deterministic; /* bitwise-reproducible gradients */
  int64_t q_start;
  int64_t k_start;
  /* Since 0.2: nonzero writes dk and dv instead of adding into them (never reading them); dq is
   * still added into. A struct_size that ends before this field (an older caller) means 0.
   * Overwritten dk and dv may have the dtype of q instead (both): rounded once. */
  int32_t overwrite_key_gradients;
  /* Since 0.3: k holds keys rotated by RoPE, and dk receives the gradient with respect to the
   * keys before the rotation (see KeyRotation in ringattn/attention.hpp): key_rotation_cos and
   * key_rotation_sin [k_len, head_dim / 2] (rank 2), the cosines and sines of key row j's
   * rotation of the pairs (i, i + head_dim / 2), in the accumulator dtype and q's memory, unit
   * stride along the last axis. Both left zeroed (rank 0): no rotation, as with a struct_size
   * that ends before them. */
  ringattn_tensor_t key_rotation_cos, key_rotation_sin;
  /* Since 0.4: the window and documents of the forward (as in ringattn_forward_params_t); a
   * struct_size that ends before them means none. */
  int64_t window_left, window_right;
  const int64_t* document_starts;
  int64_t num_documents;
  int64_t document_batch_stride;
} ringattn_backward_params_t;

/* RINGATTN_VERSION_CODE of the library that is running (major * 10000 + minor * 100 + patch). */
int ringattn_version(void);
const char* ringattn_version_string(void);
const char* ringattn_status_string(ringattn_status_t status);
/* The message of the last failed call on this thread ("" if none). Valid until the next call.
 * From Python ctypes, declare ringattn_last_error.restype = ctypes.c_char_p (as
 * bench/ringattn_ctypes.py does): ctypes' default restype is a C int, which cannot hold a
 * 64-bit pointer. */
const char* ringattn_last_error(void);
/* Number of CUDA GPUs visible (0 without CUDA). */
int ringattn_cuda_device_count(void);

/* stream: a cudaStream_t for device tensors (NULL: the default stream); ignored on the host.
 * Device calls are asynchronous to the host. */
ringattn_status_t ringattn_attention_forward(const ringattn_forward_params_t* params, void* stream);
/* delta = rowsum(dout * o): the first pass of the backward, once per final O. */
ringattn_status_t ringattn_attention_backward_prepare(const ringattn_tensor_t* o,
                                                      const ringattn_tensor_t* dout,
                                                      const ringattn_tensor_t* delta, void* stream);
/* Since 0.7: the same pass, which also sets dq (the accumulator dtype, [batch, len, heads, head_dim
 * of q]) to zero, ready for ringattn_attention_backward to add into: no separate fill of dq. */
ringattn_status_t ringattn_attention_backward_prepare_zero_dq(const ringattn_tensor_t* o,
                                                              const ringattn_tensor_t* dout,
                                                              const ringattn_tensor_t* delta,
                                                              const ringattn_tensor_t* dq,
                                                              void* stream);
ringattn_status_t ringattn_attention_backward(const ringattn_backward_params_t* params,
                                              void* stream);

/* ---- Ring attention (ringattn/ring.hpp): exact attention over a sequence split across the ranks
 * of an MPI communicator, or of NCCL alone (ringattn_ring_create_nccl). Every call is collective
 * over the ring's ranks. */

typedef struct ringattn_ring* ringattn_ring_t;

/* How the S tokens of the whole sequence are split over the N ranks; a rank's local rows are its
 * chunks one after the other (ringattn_layout_chunks lists them). */
typedef enum ringattn_layout {
  RINGATTN_CONTIGUOUS = 0, /* rank r holds tokens [r S/N, (r+1) S/N); S % N == 0 */
  RINGATTN_ZIGZAG = 1,     /* chunks r and 2N-1-r of 2N: even causal work; S % 2N == 0 */
  /* Since 0.6: chunks that make each rank's visible work even under the mask of the ring's calls
   * (causal, window, documents); S % 2N == 0. The contiguous split where that is already even (a
   * sliding window), else c of cN equal chunks a rank (c = 2 to 64), dealt by their visible work;
   * zigzag's chunks under a causal mask alone. Every ring call takes its layout from its own
   * causal, window and documents (a rank's shards must follow them: ringattn_layout_chunks with
   * the same mask), the same on every rank. */
  RINGATTN_BALANCED = 2
} ringattn_layout_t;

typedef struct ringattn_ring_forward_params {
  size_t struct_size; /* sizeof(ringattn_ring_forward_params_t) */
  ringattn_tensor_t q, k, v; /* this rank's shard: [B, S/N, H, D] (v: [B, S/N, Hkv, Dv]) */
  ringattn_tensor_t o;       /* [B, S/N, Hq, Dv] input dtype, overwritten */
  ringattn_tensor_t lse;     /* [B, Hq, S/N] accumulator dtype, overwritten; keep for backward */
  double scale;
  int32_t causal; /* by global position, whichever ranks hold the keys */
  /* Since 0.4: the window and documents by global position in the whole sequence (above), the
   * same on every rank; document_starts lists the documents of the whole sequence, not of this
   * rank's shard, in the tensors' memory. Shard pairs with nothing visible are skipped. A
   * struct_size that ends before these fields (0.1 to 0.3) means no window and one document. */
  int64_t window_left, window_right;
  const int64_t* document_starts;
  int64_t num_documents;
  int64_t document_batch_stride;
} ringattn_ring_forward_params_t;

typedef struct ringattn_ring_backward_params {
  size_t struct_size; /* sizeof(ringattn_ring_backward_params_t) */
  ringattn_tensor_t q, k, v, o, lse, dout;
  /* accumulator dtype, overwritten; on one rank dk and dv may have the dtype of q (both) */
  ringattn_tensor_t dq, dk, dv;
  double scale;
  int32_t causal;
  int32_t deterministic;
  /* Since 0.4: the forward's window and documents (as in ringattn_ring_forward_params_t). */
  int64_t window_left, window_right;
  const int64_t* document_starts;
  int64_t num_documents;
  int64_t document_batch_stride;
} ringattn_ring_backward_params_t;

/* A ring over the ranks of an MPI communicator. `mpi_comm` points to an MPI_Comm (C: &comm;
 * mpi4py: MPI._addressof(comm)), so this header needs no mpi.h; MPI must be initialised and
 * outlive the ring. memory RINGATTN_HOST: host tensors (f32, f64) over MPI; RINGATTN_DEVICE:
 * device tensors (bf16, f16) over NCCL, each rank using the GPU of its node-local rank. layout:
 * ringattn_layout_t (RINGATTN_BALANCED since 0.6). */
ringattn_status_t ringattn_ring_create(const void* mpi_comm, int32_t memory, int32_t layout,
                                       ringattn_ring_t* ring);
/* Since 0.5: a ring without MPI, for callers that bring their own process group (a
 * torch.distributed group, say). One rank makes an NCCL unique id with ringattn_nccl_unique_id
 * (RINGATTN_NCCL_UNIQUE_ID_BYTES bytes); the caller hands those bytes to every rank; each rank
 * then calls ringattn_ring_create_nccl with them, its rank and the number of ranks (collective
 * over those ranks). Device tensors (bf16, f16) only, each rank on the CUDA device current when it
 * creates the ring; the exchanges and the ring's checks between ranks go through NCCL, and no MPI
 * call is made. A library built without CUDA returns RINGATTN_ERROR_UNSUPPORTED. */
#define RINGATTN_NCCL_UNIQUE_ID_BYTES 128
ringattn_status_t ringattn_nccl_unique_id(void* id, size_t bytes);
ringattn_status_t ringattn_ring_create_nccl(const void* id, size_t bytes, int32_t rank, int32_t size,
                                            int32_t layout, ringattn_ring_t* ring);
ringattn_status_t ringattn_ring_destroy(ringattn_ring_t ring);
ringattn_status_t ringattn_ring_forward(ringattn_ring_t ring,
                                        const ringattn_ring_forward_params_t* params,
                                        void* stream);
ringattn_status_t ringattn_ring_backward(ringattn_ring_t ring,
                                         const ringattn_ring_backward_params_t* params,
                                         void* stream);

/* ---- Since 0.6: which tokens a rank holds. The one description of the layouts for callers that
 * shard, unshard or rotate (RoPE) by global position themselves: rank `rank` of `size` under
 * `layout`, for a sequence of seq_len tokens and ring calls under the mask given. The balanced
 * layout follows the mask (pass exactly the causal, window and documents of the ring calls the
 * shards go to); contiguous and zigzag ignore it (it is still checked). Host memory, no MPI: any
 * process may ask for any rank. */
typedef struct ringattn_layout_params {
  size_t struct_size; /* sizeof(ringattn_layout_params_t) */
  int32_t layout;     /* ringattn_layout_t */
  int32_t size;       /* N, the ranks of the ring, >= 1 */
  int32_t rank;       /* 0 <= rank < size */
  int32_t causal;     /* the ring calls' */
  int64_t seq_len;    /* S of the whole sequence: a multiple of N (contiguous) or 2N (the others) */
  int64_t batch;      /* the ring calls' batch (>= 1), read for per-batch lists of documents */
  /* The ring calls' window and documents as in ringattn_ring_forward_params_t, the starts in host
   * memory: [batch, num_documents] document_batch_stride apart, or one list (stride 0). */
  int64_t window_left, window_right;
  const int64_t* document_starts;
  int64_t num_documents;
  int64_t document_batch_stride;
} ringattn_layout_params_t;

/* The rank's chunks, in local order: chunk i holds the global positions [starts[i], starts[i] +
 * lengths[i]), at the local rows that follow chunk i - 1's (from row 0). *count is the number of
 * chunks (1 for contiguous, 2 for zigzag, up to 64 for balanced), set also when it exceeds
 * capacity, which fails naming the count needed (starts and lengths may be null only with
 * capacity 0); 0 after any other failure. Failures (RINGATTN_ERROR_INVALID_ARGUMENT) name the
 * field, its value and what was expected: a layout code, size, rank or batch out of range, a
 * seq_len that is not a positive multiple of N (contiguous) or 2N, a negative window, a null or
 * decreasing list of starts, a struct_size that is not this struct's. */
ringattn_status_t ringattn_layout_chunks(const ringattn_layout_params_t* params, int64_t* starts,
                                         int64_t* lengths, int64_t capacity, int64_t* count);

#ifdef __cplusplus
}
#endif

#endif /* RINGATTN_RINGATTN_H */
