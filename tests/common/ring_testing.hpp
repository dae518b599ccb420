// Helpers of the ring tests on CPU ranks (tests/parallel/mpi_ring_*.cpp): the five outputs of a
// whole problem, rank 0's copy of them on every rank, the whole problem with its two references
// (the fp64 oracle and the CPU flash block in one process), and a rank's shards gathered into a
// whole tensor.
#pragma once

#include <mpi.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn::test {

// Outputs of the whole problem as logical [B, S, H, D] / [B, H, S] values.
struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
};

inline constexpr const char* kNames[] = {"O", "LSE", "dQ", "dK", "dV"};
inline std::vector<double> Outputs::*const kFields[] = {&Outputs::o, &Outputs::lse,
                                                        &Outputs::dq, &Outputs::dk, &Outputs::dv};

// The whole outputs of rank 0 (of shape s) on every rank: the oracle and the one-process run are
// computed once, not by each of 8 ranks oversubscribing 2 cores.
inline Outputs broadcast_from_rank0(const Outputs& mine, const AttentionShape& s) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t q_rows = s.batch * s.q_len * s.q_heads,
                     k_rows = s.batch * s.k_len * s.kv_heads;
  const std::int64_t counts[] = {q_rows * s.value_dim(), q_rows, q_rows * s.head_dim,
                                 k_rows * s.head_dim, k_rows * s.value_dim()};
  Outputs out = rank == 0 ? mine : Outputs{};
  for (int i = 0; i < 5; ++i) {
    std::vector<double>& values = out.*kFields[i];
    values.resize(static_cast<std::size_t>(counts[i]));
    EXPECT_EQ(MPI_Bcast(values.data(), static_cast<int>(counts[i]), MPI_DOUBLE, 0, MPI_COMM_WORLD),
              MPI_SUCCESS);
  }
  return out;
}

// A ring call's outputs on the host: O and LSE (NaN until written), dQ, dK and dV (filled with
// `gradient_fill`), for the shape `s` (a rank's shard, or the whole sequence).
template <typename T>
struct OutputTensors {
  HostTensor<T> o, lse, dq, dk, dv;

  explicit OutputTensors(const AttentionShape& s,
                         T gradient_fill = std::numeric_limits<T>::quiet_NaN())
      : o({s.batch, s.q_len, s.q_heads, s.value_dim()}),
        lse({s.batch, s.q_heads, s.q_len}),
        dq({s.batch, s.q_len, s.q_heads, s.head_dim}, gradient_fill),
        dk({s.batch, s.k_len, s.kv_heads, s.head_dim}, gradient_fill),
        dv({s.batch, s.k_len, s.kv_heads, s.value_dim()}, gradient_fill) {}

  std::array<HostTensor<T>*, 5> all() { return {&o, &lse, &dq, &dk, &dv}; }
  Outputs values() const {
    return {o.values(), lse.values(), dq.values(), dk.values(), dv.values()};
  }
};

// The fp64 oracle's five outputs for inputs of shape `s` (any host dtype) under `mask`; its
// backward overwrites dQ, dK and dV.
inline Outputs oracle_outputs(const AttentionShape& s, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& dout, const Mask& mask,
                              double scale) {
  OutputTensors<double> out(s);
  reference::attention_forward(q, k, v, mask, scale, out.o.view, out.lse.view);
  reference::attention_backward(q, k, v, dout, mask, scale, out.dq.view, out.dk.view, out.dv.view);
  return out.values();
}

// The whole problem of a ring test: random Q, K, V and dO of shape `s` (V and dO of d_v), the
// same on every rank (the mpi main gives every rank rank 0's seed), and its two references under
// a mask.
template <typename T>
struct WholeProblem {
  AttentionShape s;
  double scale;
  HostTensor<T> q, k, v, dout;

  WholeProblem(const AttentionShape& shape, std::mt19937_64& rng)
      : s(shape),
        scale(default_scale(shape.head_dim)),
        q({s.batch, s.q_len, s.q_heads, s.head_dim}),
        k({s.batch, s.k_len, s.kv_heads, s.head_dim}),
        v({s.batch, s.k_len, s.kv_heads, s.value_dim()}),
        dout({s.batch, s.q_len, s.q_heads, s.value_dim()}) {
    for (HostTensor<T>* t : {&q, &k, &v, &dout}) fill_normal(t->storage, rng);
  }

  // The fp64 oracle on the same (rounded) inputs.
  Outputs oracle(const Mask& mask) const {
    return oracle_outputs(s, q.view, k.view, v.view, dout.view, mask, scale);
  }

  // The CPU flash block on the whole problem in this process (the ring over one rank), whose
  // error bounds the f32 ring's; its backward adds into dQ, dK and dV, so they start at zero.
  Outputs one_process(const Mask& mask) const {
    OutputTensors<T> out(s, T(0));
    HostTensor<T> delta({s.batch, s.q_heads, s.q_len});
    cpu::flash_forward({q.view, k.view, v.view, out.o.view, out.lse.view, scale, mask, false});
    cpu::flash_backward_prepare(out.o.view, dout.view, delta.view);
    cpu::flash_backward({q.view, k.view, v.view, dout.view, out.lse.view, delta.view, out.dq.view,
                         out.dk.view, out.dv.view, scale, mask, false});
    return out.values();
  }
};

// The ring's forward and backward of this rank's shards under `mask` (its causal flag, window
// and documents; q_start and k_start unused) into `out`.
template <typename T>
void run_ring(RingAttention& ring, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& dout, OutputTensors<T>& out, double scale, const Mask& mask) {
  RingForwardArgs forward;
  forward.q = q;
  forward.k = k;
  forward.v = v;
  forward.o = out.o.view;
  forward.lse = out.lse.view;
  forward.scale = scale;
  forward.causal = mask.causal;
  forward.window_left = mask.window_left;
  forward.window_right = mask.window_right;
  forward.documents = mask.documents;
  ring.forward(forward);
  RingBackwardArgs backward;
  backward.q = q;
  backward.k = k;
  backward.v = v;
  backward.o = out.o.view;
  backward.lse = out.lse.view;
  backward.dout = dout;
  backward.dq = out.dq.view;
  backward.dk = out.dk.view;
  backward.dv = out.dv.view;
  backward.scale = scale;
  backward.causal = mask.causal;
  backward.window_left = mask.window_left;
  backward.window_right = mask.window_right;
  backward.documents = mask.documents;
  ring.backward(backward);
}

// Every rank's shard of a contiguous local tensor, gathered and unsharded into `whole`.
template <typename T>
void gather_whole(const HostTensor<T>& local, SequenceLayoutKind kind, const Communicator& comm,
                  const TensorView& whole) {
  const std::size_t count = local.storage.size();
  std::vector<T> all(count * static_cast<std::size_t>(comm.size()));
  comm.host_all_gather(local.storage.data(), count * sizeof(T), all.data());
  const std::int64_t total = local.view.rank == 4 ? whole.shape[1] : whole.shape[2];
  for (int p = 0; p < comm.size(); ++p) {
    TensorView shard = local.view;
    shard.data = all.data() + p * count;
    SequenceLayout(kind, comm.size(), p, total).unshard(shard, whole);
  }
}

}  // namespace ringattn::test
