# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `capi` (sourced by tests/faults/run_case.sh): bad calls of the C API
# (include/ringattn/ringattn.h) made by tests/faults/capi_faults.c, one call a case on a small valid
# f64 problem with one thing broken: null pointers, short structs, bad dtype/memory/rank codes,
# strides and extents, shapes that do not match, overlapping outputs, bad scales, and the ring's
# handle and arguments. The program prints "CALL: status N (name): ringattn_last_error()" and exits
# with the status, so each case checks the code (expect_status), the function the caller called,
# and the argument, value and expectation the message names. The ring_*_np2 cases run the ring over
# two ranks, where a fault of one rank (or a disagreement) fails the call on every rank alike.

# capi_case NAME STATUS TEXT...: the program runs case NAME (without _np2) and must return STATUS and
# print every TEXT.
capi_case() {
  command=("$capi" "$1")
  expect_status=$2
  shift 2
  expect=("$@")
}

define_case() {
  local f="ringattn_attention_forward: status 1 (invalid argument): ringattn_attention_forward:"
  local b="ringattn_attention_backward: status 1 (invalid argument): ringattn_attention_backward:"
  local p="ringattn_attention_backward_prepare: status 1 (invalid argument): ringattn_attention_backward_prepare:"
  local r="ringattn_ring_create: status 1 (invalid argument): ringattn_ring_create:"
  local n="ringattn_ring_create_nccl: status 1 (invalid argument): ringattn_ring_create_nccl:"
  case $1 in
    # ---- ringattn_attention_forward ----
    forward_null_params) capi_case "$1" 1 "$f params is a null pointer" ;;
    forward_struct_size_zero)
      capi_case "$1" 1 "$f params->struct_size is 0; expected sizeof = " "(set it to sizeof(the struct))" ;;
    forward_null_q) capi_case "$1" 1 "$f q is a null pointer" ;;
    forward_k_rank3) capi_case "$1" 1 "$f k has rank 3 (shape [1, 8, 4]); expected rank 4" ;;
    forward_dtype_code)
      capi_case "$1" 1 "$f q has dtype code 7; expected 0 (f32), 1 (f64), 2 (f16) or 3 (bf16)" ;;
    forward_memory_code) capi_case "$1" 1 "$f v has memory code 5; expected 0 (host) or 1 (device)" ;;
    forward_rank_code) capi_case "$1" 1 "$f o has rank 9; expected 0 to 4" ;;
    forward_negative_stride) capi_case "$1" 1 "$f q has stride -8 on axis 1; expected >= 1" ;;
    forward_zero_stride) capi_case "$1" 1 "$f k has stride 0 on axis 1; expected >= 1" ;;
    forward_negative_extent)
      capi_case "$1" 1 "$f q has extent -3 on axis 1 (shape [1, -3, 2, 4]); expected >= 0" ;;
    forward_element_overflow)
      capi_case "$1" 1 "$f the element count of q (shape [4611686018427387903, 8, 2, 4]) overflows int64" ;;
    forward_span_overflow)  # strides whose span passes int64
      capi_case "$1" 1 "$f the span of q in elements overflows int64" ;;
    forward_gqa_ratio)
      capi_case "$1" 1 "$f q has 3 heads, not a multiple of the 2 heads of k and v (GQA needs q_heads % kv_heads == 0)" ;;
    forward_k_dtype) capi_case "$1" 1 "$f k has dtype f32; expected f64 (the dtype of q)" ;;
    forward_lse_dtype)
      capi_case "$1" 1 "$f lse has dtype f32; expected f64 (the accumulator dtype of the inputs)" ;;
    forward_lse_shape)
      capi_case "$1" 1 "$f lse has shape [1, 8, 2]; expected [1, 2, 8] ([batch, q_heads, q_len])" ;;
    forward_v_len)
      capi_case "$1" 1 "$f v has shape [1, 4, 1, 4]; expected [1, 8, 1, 4] (batch, k_len and kv_heads of k)" ;;
    forward_o_overlaps_q)
      capi_case "$1" 1 "$f o overlaps q (o [" "outputs may share no memory with inputs or other outputs" ;;
    forward_lse_overlaps_o) capi_case "$1" 1 "$f lse overlaps o (lse [" ;;
    forward_scale_zero)
      capi_case "$1" 1 "$f scale is 0; expected a finite value > 0 such as 1/sqrt(head_dim)" ;;
    forward_scale_nan) capi_case "$1" 1 "$f scale is nan; expected a finite value > 0" ;;
    forward_scale_inf) capi_case "$1" 1 "$f scale is inf; expected a finite value > 0" ;;
    forward_q_start_overflow)  # the rows' positions q_start + i would pass int64: refused
      capi_case "$1" 1 "$f q_start" ;;
    forward_k_start_overflow)  # the same of k_start
      capi_case "$1" 1 "$f k_start" ;;
    forward_mixed_memory) capi_case "$1" 1 "$f k is in device memory; expected host memory" ;;
    forward_host_f16)  # the CPU block's dtypes (named by the block, not by the C function)
      capi_case "$1" 1 "ringattn_attention_forward: status 1 (invalid argument): cpu::flash_forward: q has dtype f16; the CPU block takes f32 or f64" ;;
    forward_device_memory)  # refused by dtype before any GPU is asked for
      capi_case "$1" 1 "ringattn_attention_forward: status 1 (invalid argument): cuda::flash_forward: q has dtype f64; device tensors run on the CUDA block, which takes bf16 or f16" ;;

    # ---- ringattn_attention_backward_prepare and _backward ----
    prepare_null_delta) capi_case "$1" 1 "$p delta is a null pointer" ;;
    prepare_delta_shape)
      capi_case "$1" 1 "$p delta has shape [1, 8, 2]; expected [1, 2, 8] ([batch, heads, len] of o)" ;;
    prepare_delta_overlaps_dout) capi_case "$1" 1 "$p delta overlaps dout (delta [" ;;
    prepare_dout_shape)
      capi_case "$1" 1 "$p dout has shape [1, 8, 1, 8]; expected [1, 8, 2, 4] (the shape of o)" ;;
    backward_null_params) capi_case "$1" 1 "$b params is a null pointer" ;;
    backward_struct_size_short)  # shorter than the first version of the struct
      capi_case "$1" 1 "$b params->struct_size is " "; expected sizeof = " ;;
    backward_dq_overlaps_dk) capi_case "$1" 1 "$b dk overlaps dq (dk [" ;;
    backward_dk_shape)
      capi_case "$1" 1 "$b dk has shape [1, 8, 2, 2]; expected [1, 8, 1, 4] (the shape of k)" ;;
    backward_delta_dtype)
      capi_case "$1" 1 "$b delta has dtype f32; expected f64 (the accumulator dtype of the inputs)" ;;
    backward_null_dv) capi_case "$1" 1 "$b dv is a null pointer" ;;
    backward_rotation_rank) capi_case "$1" 1 "$b key_rotation.cos has rank 3 (shape [1, 8, 2]); expected rank 2" ;;
    backward_rotation_half)  # cos given, sin left empty
      capi_case "$1" 1 "$b key_rotation.sin has rank 0 (shape []); expected rank 2" ;;

    # ---- the ring ----
    ring_create_null_out) capi_case "$1" 1 "$r ring (the output) is a null pointer" ;;
    ring_create_null_comm)
      capi_case "$1" 1 "$r mpi_comm is a null pointer; pass the address of an MPI_Comm" ;;
    ring_create_memory_code)
      capi_case "$1" 1 "$r memory is 7; expected 0 (host, MPI) or 1 (device, NCCL)" ;;
    ring_create_layout_code) capi_case "$1" 1 "$r layout is 5; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)" ;;
    ring_create_nccl_null_id) capi_case "$1" 1 "$n id is a null pointer" ;;
    ring_create_nccl_id_bytes)
      capi_case "$1" 1 "$n bytes is 64; an NCCL unique id is RINGATTN_NCCL_UNIQUE_ID_BYTES (128) bytes" ;;
    ring_create_nccl_rank) capi_case "$1" 1 "$n rank is 2; expected 0 <= rank < size (2)" ;;
    ring_create_nccl_size) capi_case "$1" 1 "$n size is 0; expected the number of ranks, >= 1" ;;
    ring_create_nccl_layout) capi_case "$1" 1 "$n layout is 3; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)" ;;
    ring_create_nccl_null_out) capi_case "$1" 1 "$n ring (the output) is a null pointer" ;;
    ring_nccl_unique_id_bytes)
      capi_case "$1" 1 "ringattn_nccl_unique_id: status 1 (invalid argument): ringattn_nccl_unique_id: bytes is 127; an NCCL unique id is RINGATTN_NCCL_UNIQUE_ID_BYTES (128) bytes" ;;
    ring_forward_null_handle)
      capi_case "$1" 1 "ringattn_ring_forward: status 1 (invalid argument): ringattn_ring_forward: ring is a null handle (create it with ringattn_ring_create)" ;;
    ring_forward_null_params)
      capi_case "$1" 1 "ringattn_ring_forward: status 1 (invalid argument): ringattn_ring_forward: params is a null pointer" ;;
    ring_backward_null_params)
      capi_case "$1" 1 "ringattn_ring_backward: status 1 (invalid argument): ringattn_ring_backward: params is a null pointer" ;;
    ring_forward_k_len)
      capi_case "$1" 1 "ringattn_ring_forward: status 1 (invalid argument): RingAttention::forward: k has 4 tokens but q has 8; every rank holds the same tokens of q, k and v" ;;

    # ---- the ring on two ranks: every rank gets the same refusal ----
    ring_forward_k_len_np2)
      capi_case ring_forward_k_len 1 "RingAttention::forward: k has 4 tokens but q has 8; every rank holds the same tokens of q, k and v (on every rank)"
      command=("${np2[@]}" "${command[@]}")
      expect_count=2 expect_ranks=2 ;;
    ring_rank1_null_q_np2)  # rank 1 alone passes a null q: named on both ranks
      capi_case ring_rank1_null_q 1 "ringattn_ring_forward: status 1 (invalid argument): RingAttention::forward: rank 1: q is a null pointer"
      command=("${np2[@]}" "${command[@]}")
      expect_count=2 expect_ranks=2 ;;
    ring_rank1_scale_np2)
      capi_case ring_rank1_scale 1 "RingAttention::forward: the ranks disagree: rank 0 has scale 0.5 but rank 1 has scale 0.25"
      command=("${np2[@]}" "${command[@]}")
      expect_count=2 expect_ranks=2 ;;
    *) return 1 ;;
  esac
}
