/* ringattn_faults_capi CASE: makes one bad call of the C API (include/ringattn/ringattn.h), named
 * by CASE, on a small valid f64 host problem with one thing broken, and prints what came back:
 *
 *   CALL: status N (status string): message of ringattn_last_error()
 *
 * Exit status: the returned status code (nonzero on an error return; 0 when the call was taken,
 * which a fault case counts as a silent accept), or 64 for an unknown CASE. The ring_* cases start
 * MPI (under mpiexec, every rank prints its lines prefixed "rank R: "), and the ring_rank1_* cases
 * break the call on rank 1 only. tests/faults/capi.sh lists the cases and what each must print.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ringattn/ringattn.h"

/* The problem: q [B, S, HQ, D], k and v [B, S, HKV, D], lse and delta [B, HQ, S]. */
enum { B = 1, S = 8, HQ = 2, HKV = 1, D = 4 };
enum { QN = B * S * HQ * D, KN = B * S * HKV * D, LN = B * HQ * S };

static double q[QN], k[KN], v[KN], o[QN], dout[QN], dq[QN], dk[KN], dv[KN];
static double lse[LN], delta[LN], rot_cos[S * D / 2], rot_sin[S * D / 2];
static int world_rank = 0, world_size = 1;

/* A row-major f64 host descriptor of `rank` extents at `data`. */
static ringattn_tensor_t describe(void* data, int rank, int64_t e0, int64_t e1, int64_t e2,
                                  int64_t e3) {
  ringattn_tensor_t t;
  const int64_t extents[4] = {e0, e1, e2, e3};
  int64_t stride = 1;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = RINGATTN_F64;
  t.memory = RINGATTN_HOST;
  t.rank = rank;
  for (int i = rank - 1; i >= 0; --i) {
    t.shape[i] = extents[i];
    t.strides[i] = stride;
    stride *= extents[i];
  }
  return t;
}

static ringattn_forward_params_t forward_params(void) {
  ringattn_forward_params_t p;
  memset(&p, 0, sizeof p);
  p.struct_size = sizeof p;
  p.q = describe(q, 4, B, S, HQ, D);
  p.k = describe(k, 4, B, S, HKV, D);
  p.v = describe(v, 4, B, S, HKV, D);
  p.o = describe(o, 4, B, S, HQ, D);
  p.lse = describe(lse, 3, B, HQ, S, 0);
  p.scale = 0.5;
  p.causal = 1;
  return p;
}

static ringattn_backward_params_t backward_params(void) {
  ringattn_backward_params_t p;
  memset(&p, 0, sizeof p);
  p.struct_size = sizeof p;
  p.q = describe(q, 4, B, S, HQ, D);
  p.k = describe(k, 4, B, S, HKV, D);
  p.v = describe(v, 4, B, S, HKV, D);
  p.dout = describe(dout, 4, B, S, HQ, D);
  p.lse = describe(lse, 3, B, HQ, S, 0);
  p.delta = describe(delta, 3, B, HQ, S, 0);
  p.dq = describe(dq, 4, B, S, HQ, D);
  p.dk = describe(dk, 4, B, S, HKV, D);
  p.dv = describe(dv, 4, B, S, HKV, D);
  p.scale = 0.5;
  p.causal = 1;
  return p;
}

/* The ring's shard of this rank: the same shapes, S tokens a rank. */
static ringattn_ring_forward_params_t ring_forward_params(void) {
  ringattn_ring_forward_params_t p;
  memset(&p, 0, sizeof p);
  p.struct_size = sizeof p;
  p.q = describe(q, 4, B, S, HQ, D);
  p.k = describe(k, 4, B, S, HKV, D);
  p.v = describe(v, 4, B, S, HKV, D);
  p.o = describe(o, 4, B, S, HQ, D);
  p.lse = describe(lse, 3, B, HQ, S, 0);
  p.scale = 0.5;
  p.causal = 1;
  return p;
}

/* Prints the outcome of `call` and gives the exit status: the status code. */
static int report(const char* call, ringattn_status_t status) {
  if (world_size > 1) printf("rank %d: ", world_rank);
  printf("%s: status %d (%s): %s\n", call, (int)status, ringattn_status_string(status),
         status == RINGATTN_SUCCESS ? "the call was taken" : ringattn_last_error());
  fflush(stdout);
  return (int)status;
}

static int forward_case(const char* name) {
  ringattn_forward_params_t p = forward_params();
  if (strcmp(name, "forward_null_params") == 0) {
    return report("ringattn_attention_forward", ringattn_attention_forward(NULL, NULL));
  } else if (strcmp(name, "forward_struct_size_zero") == 0) {
    p.struct_size = 0;
  } else if (strcmp(name, "forward_null_q") == 0) {
    p.q.data = NULL;
  } else if (strcmp(name, "forward_k_rank3") == 0) {
    p.k = describe(k, 3, B, S, HKV * D, 0);
  } else if (strcmp(name, "forward_dtype_code") == 0) {
    p.q.dtype = 7;
  } else if (strcmp(name, "forward_memory_code") == 0) {
    p.v.memory = 5;
  } else if (strcmp(name, "forward_rank_code") == 0) {
    p.o.rank = 9;
  } else if (strcmp(name, "forward_negative_stride") == 0) {
    p.q.strides[1] = -(int64_t)(HQ * D);
  } else if (strcmp(name, "forward_zero_stride") == 0) {
    p.k.strides[1] = 0;
  } else if (strcmp(name, "forward_negative_extent") == 0) {
    p.q.shape[1] = -3;
  } else if (strcmp(name, "forward_gqa_ratio") == 0) {
    p.q = describe(q, 4, B, S / 2, 3, D);
    p.o = describe(o, 4, B, S / 2, 3, D);
    p.lse = describe(lse, 3, B, 3, S / 2, 0);
    p.k = describe(k, 4, B, S / 4, 2, D);
    p.v = describe(v, 4, B, S / 4, 2, D);
  } else if (strcmp(name, "forward_k_dtype") == 0) {
    p.k.dtype = RINGATTN_F32;
  } else if (strcmp(name, "forward_lse_dtype") == 0) {
    p.lse.dtype = RINGATTN_F32;
  } else if (strcmp(name, "forward_lse_shape") == 0) {
    p.lse = describe(lse, 3, B, S, HQ, 0);
  } else if (strcmp(name, "forward_v_len") == 0) {
    p.v = describe(v, 4, B, S / 2, HKV, D);
  } else if (strcmp(name, "forward_o_overlaps_q") == 0) {
    p.o.data = q;
  } else if (strcmp(name, "forward_lse_overlaps_o") == 0) {
    p.lse.data = o + 4;
  } else if (strcmp(name, "forward_scale_zero") == 0) {
    p.scale = 0.0;
  } else if (strcmp(name, "forward_scale_nan") == 0) {
    p.scale = NAN;
  } else if (strcmp(name, "forward_scale_inf") == 0) {
    p.scale = INFINITY;
  } else if (strcmp(name, "forward_host_f16") == 0) {
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = RINGATTN_F16;
    p.lse.dtype = RINGATTN_F32;
  } else if (strcmp(name, "forward_device_memory") == 0) {
    p.q.memory = p.k.memory = p.v.memory = p.o.memory = p.lse.memory = RINGATTN_DEVICE;
  } else if (strcmp(name, "forward_mixed_memory") == 0) {
    p.k.memory = RINGATTN_DEVICE;
  } else if (strcmp(name, "forward_span_overflow") == 0) {
    p.q.strides[0] = INT64_MAX / 2;
    p.q.shape[0] = 3;
    p.k.shape[0] = p.v.shape[0] = p.o.shape[0] = p.lse.shape[0] = 3;
  } else if (strcmp(name, "forward_element_overflow") == 0) {
    p.q.shape[0] = INT64_MAX / 2;
  } else if (strcmp(name, "forward_q_start_overflow") == 0) {
    p.q_start = INT64_MAX - 2; /* the positions of rows 3 to 7 pass int64 */
  } else if (strcmp(name, "forward_k_start_overflow") == 0) {
    p.k_start = INT64_MAX - 2;
  } else {
    return -1;
  }
  return report("ringattn_attention_forward", ringattn_attention_forward(&p, NULL));
}

static int prepare_case(const char* name) {
  ringattn_tensor_t o_t = describe(o, 4, B, S, HQ, D), dout_t = describe(dout, 4, B, S, HQ, D);
  ringattn_tensor_t delta_t = describe(delta, 3, B, HQ, S, 0);
  const ringattn_tensor_t* delta_arg = &delta_t;
  if (strcmp(name, "prepare_null_delta") == 0) {
    delta_arg = NULL;
  } else if (strcmp(name, "prepare_delta_shape") == 0) {
    delta_t = describe(delta, 3, B, S, HQ, 0);
  } else if (strcmp(name, "prepare_delta_overlaps_dout") == 0) {
    delta_t.data = dout + 8;
  } else if (strcmp(name, "prepare_dout_shape") == 0) {
    dout_t = describe(dout, 4, B, S, HQ / 2, D * 2);
  } else {
    return -1;
  }
  return report("ringattn_attention_backward_prepare",
                ringattn_attention_backward_prepare(&o_t, &dout_t, delta_arg, NULL));
}

static int backward_case(const char* name) {
  ringattn_backward_params_t p = backward_params();
  if (strcmp(name, "backward_null_params") == 0) {
    return report("ringattn_attention_backward", ringattn_attention_backward(NULL, NULL));
  } else if (strcmp(name, "backward_struct_size_short") == 0) {
    p.struct_size = offsetof(ringattn_backward_params_t, overwrite_key_gradients) - 8;
  } else if (strcmp(name, "backward_dq_overlaps_dk") == 0) {
    p.dk.data = dq + 8;
  } else if (strcmp(name, "backward_dk_shape") == 0) {
    p.dk = describe(dk, 4, B, S, HQ, D / 2);
  } else if (strcmp(name, "backward_delta_dtype") == 0) {
    p.delta.dtype = RINGATTN_F32;
  } else if (strcmp(name, "backward_null_dv") == 0) {
    p.dv.data = NULL;
  } else if (strcmp(name, "backward_rotation_rank") == 0) {
    p.key_rotation_cos = describe(rot_cos, 3, 1, S, D / 2, 0);
    p.key_rotation_sin = describe(rot_sin, 2, S, D / 2, 0, 0);
  } else if (strcmp(name, "backward_rotation_half") == 0) {
    p.key_rotation_cos = describe(rot_cos, 2, S, D / 2, 0, 0);
  } else {
    return -1;
  }
  return report("ringattn_attention_backward", ringattn_attention_backward(&p, NULL));
}

/* The ring cases: a handle over MPI_COMM_WORLD (MPI started by main). */
static int ring_case(const char* name) {
  MPI_Comm comm = MPI_COMM_WORLD;
  ringattn_ring_t ring = NULL;
  int status;
  if (strcmp(name, "ring_create_null_out") == 0) {
    return report("ringattn_ring_create",
                  ringattn_ring_create(&comm, RINGATTN_HOST, RINGATTN_ZIGZAG, NULL));
  } else if (strcmp(name, "ring_create_null_comm") == 0) {
    return report("ringattn_ring_create",
                  ringattn_ring_create(NULL, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_memory_code") == 0) {
    return report("ringattn_ring_create", ringattn_ring_create(&comm, 7, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_layout_code") == 0) {
    return report("ringattn_ring_create", ringattn_ring_create(&comm, RINGATTN_HOST, 5, &ring));
  } else if (strcmp(name, "ring_create_nccl_null_id") == 0) {
    return report("ringattn_ring_create_nccl",
                  ringattn_ring_create_nccl(NULL, RINGATTN_NCCL_UNIQUE_ID_BYTES, 0, 1, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_nccl_id_bytes") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_ring_create_nccl", ringattn_ring_create_nccl(id, 64, 0, 1, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_nccl_rank") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_ring_create_nccl",
                  ringattn_ring_create_nccl(id, sizeof id, 2, 2, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_nccl_size") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_ring_create_nccl",
                  ringattn_ring_create_nccl(id, sizeof id, 0, 0, RINGATTN_ZIGZAG, &ring));
  } else if (strcmp(name, "ring_create_nccl_layout") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_ring_create_nccl", ringattn_ring_create_nccl(id, sizeof id, 0, 1, 3, &ring));
  } else if (strcmp(name, "ring_create_nccl_null_out") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_ring_create_nccl",
                  ringattn_ring_create_nccl(id, sizeof id, 0, 1, RINGATTN_ZIGZAG, NULL));
  } else if (strcmp(name, "ring_nccl_unique_id_bytes") == 0) {
    unsigned char id[RINGATTN_NCCL_UNIQUE_ID_BYTES] = {0};
    return report("ringattn_nccl_unique_id", ringattn_nccl_unique_id(id, 127));
  } else if (strcmp(name, "ring_forward_null_handle") == 0) {
    ringattn_ring_forward_params_t p = ring_forward_params();
    return report("ringattn_ring_forward", ringattn_ring_forward(NULL, &p, NULL));
  }
  status = ringattn_ring_create(&comm, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring);
  if (status != RINGATTN_SUCCESS) return report("ringattn_ring_create", status);
  if (strcmp(name, "ring_forward_null_params") == 0) {
    status = report("ringattn_ring_forward", ringattn_ring_forward(ring, NULL, NULL));
  } else if (strcmp(name, "ring_forward_k_len") == 0) {
    ringattn_ring_forward_params_t p = ring_forward_params();
    p.k = describe(k, 4, B, S / 2, HKV, D);
    p.v = describe(v, 4, B, S / 2, HKV, D);
    status = report("ringattn_ring_forward", ringattn_ring_forward(ring, &p, NULL));
  } else if (strcmp(name, "ring_rank1_null_q") == 0) {
    ringattn_ring_forward_params_t p = ring_forward_params();
    if (world_rank == 1) p.q.data = NULL;
    status = report("ringattn_ring_forward", ringattn_ring_forward(ring, &p, NULL));
  } else if (strcmp(name, "ring_rank1_scale") == 0) {
    ringattn_ring_forward_params_t p = ring_forward_params();
    if (world_rank == 1) p.scale = 0.25;
    status = report("ringattn_ring_forward", ringattn_ring_forward(ring, &p, NULL));
  } else if (strcmp(name, "ring_backward_null_params") == 0) {
    status = report("ringattn_ring_backward", ringattn_ring_backward(ring, NULL, NULL));
  } else {
    status = -1;
  }
  ringattn_ring_destroy(ring);
  return status;
}

int main(int argc, char** argv) {
  const char* name = argc == 2 ? argv[1] : "";
  int status;
  for (int i = 0; i < QN; ++i) q[i] = o[i] = dout[i] = dq[i] = sin(0.1 * i);
  for (int i = 0; i < KN; ++i) k[i] = v[i] = dk[i] = dv[i] = cos(0.1 * i);
  for (int i = 0; i < LN; ++i) lse[i] = delta[i] = 0.0;
  for (int i = 0; i < S * D / 2; ++i) rot_cos[i] = rot_sin[i] = 0.5;
  if (strncmp(name, "ring_", 5) == 0) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    status = ring_case(name);
    MPI_Finalize();
  } else if (strncmp(name, "forward_", 8) == 0) {
    status = forward_case(name);
  } else if (strncmp(name, "prepare_", 8) == 0) {
    status = prepare_case(name);
  } else if (strncmp(name, "backward_", 9) == 0) {
    status = backward_case(name);
  } else {
    status = -1;
  }
  if (status < 0) {
    fprintf(stderr, "ringattn_faults_capi: unknown case '%s'\n", name);
    return 64;
  }
  return status;
}
