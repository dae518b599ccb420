// ringattn-mpi-ranks: 1 2 3
// The C API's balanced ring (RINGATTN_BALANCED, since 0.6), host f64 tensors over MPI_COMM_WORLD,
// sharded as a caller of the C API shards: by ringattn_layout_chunks with the calls' mask.
//   - O, LSE, dQ, dK and dV against the fp64 oracle on the whole sequence under the same mask,
//     sharded by the same chunks: relative error under 1e-12. A layout that disagreed with the
//     ring's own (the one each call makes from its mask) would put rows at other positions and
//     fail here.
//   - the shards equal the C++ ring's shard(full, local, mask) and the outputs the C++ balanced
//     ring's, bitwise;
//   - the masks give layouts of their own on more than one rank (other than zigzag's and the
//     contiguous split), so the comparisons see what only the balanced layout does.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/common/ring_testing.hpp"

namespace {

using ringattn::DType;
using ringattn::TensorView;
using ringattn::test::describe;

constexpr std::int64_t B = 2, Hq = 4, Hkv = 2, D = 8;
constexpr double kScale = 0.3;

TensorView view(std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(d.data(), DType::f64, shape);
}

// The calls' mask: starts [B, count] per batch row (batch_stride count) or one list (stride 0).
struct Case {
  const char* name;
  std::int64_t seq_len;  // a multiple of 2N for N = 1, 2, 3
  bool causal;
  std::int64_t window_left, window_right;
  std::vector<std::int64_t> starts;
  std::int64_t count, batch_stride;

  ringattn::Mask mask() const {
    ringattn::Mask m{causal, 0, 0, window_left, window_right};
    m.documents = {count > 0 ? starts.data() : nullptr, count, batch_stride};
    return m;
  }
};

struct Chunk {
  std::int64_t start, length;
};

// This rank's chunks from the C API, for the calls of `c`.
std::vector<Chunk> layout_chunks(const Case& c, int size, int rank) {
  ringattn_layout_params_t p{};
  p.struct_size = sizeof(p);
  p.layout = RINGATTN_BALANCED;
  p.size = size;
  p.rank = rank;
  p.causal = c.causal ? 1 : 0;
  p.seq_len = c.seq_len;
  p.batch = B;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.document_starts = c.count > 0 ? c.starts.data() : nullptr;
  p.num_documents = c.count;
  p.document_batch_stride = c.batch_stride;
  std::vector<std::int64_t> starts(64), lengths(64);
  std::int64_t count = 0;
  EXPECT_EQ(ringattn_layout_chunks(&p, starts.data(), lengths.data(), 64, &count), RINGATTN_SUCCESS)
      << ringattn_last_error();
  std::vector<Chunk> chunks;
  for (std::int64_t i = 0; i < count; ++i) chunks.push_back({starts[i], lengths[i]});
  return chunks;
}

// Rows of the whole [B, S, H, W] (or, with `lse`, [B, H, S]) tensor at the chunks' positions,
// in local order.
std::vector<double> take_rows(const std::vector<double>& whole, std::int64_t seq_len,
                              std::int64_t heads, std::int64_t width,
                              const std::vector<Chunk>& chunks, bool lse = false) {
  std::vector<std::int64_t> rows;
  for (const Chunk& c : chunks) {
    for (std::int64_t i = 0; i < c.length; ++i) rows.push_back(c.start + i);
  }
  const auto local = static_cast<std::int64_t>(rows.size());
  std::vector<double> out(static_cast<std::size_t>(B * local * heads * width));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < local; ++i) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t x = 0; x < width; ++x) {
          const std::int64_t to =
              lse ? (b * heads + h) * local + i : ((b * local + i) * heads + h) * width + x;
          const std::int64_t from = lse ? (b * heads + h) * seq_len + rows[i]
                                        : ((b * seq_len + rows[i]) * heads + h) * width + x;
          out[to] = whole[from];
        }
      }
    }
  }
  return out;
}

using Results = ringattn::test::Outputs;

TEST(CApiRingBalanced, EqualsTheOracleAndTheCppRing) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  int size = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Their layouts (on 2 and 3 ranks): none is zigzag's but the last; the window of the third
  // makes the contiguous split even on 2 ranks.
  const Case cases[] = {
      // Per-batch documents (row 1: an empty document, a start past the end) under causality: at
      // 1536 tokens the layout deals 4 chunks of 192 a rank on 2 ranks.
      {"causal, per-batch documents",
       1536,
       true,
       0,
       0,
       {0, 500, 1200, 1210, 1220, 0, 40, 40, 900, 2000},
       5,
       5},
      {"two-sided window and documents", 192, false, 50, 30, {0, 30, 31, 40}, 4, 0},
      {"causal window, per-batch documents",
       384,
       true,
       40,
       0,
       {0, 300, 310, 320, 0, 250, 250, 400},
       4,
       4},
      {"causal alone", 96, true, 0, 0, {}, 0, 0},
  };
  ringattn_ring_t ring = nullptr;
  const MPI_Comm world = MPI_COMM_WORLD;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, RINGATTN_BALANCED, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();
  ringattn::RingAttention cpp(ringattn::mpi_world_communicator(),
                              ringattn::SequenceLayoutKind::balanced);
  int own_layouts = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::int64_t S = c.seq_len, Sl = S / size;
    std::mt19937_64 rng = ringattn::test::make_rng(S);  // the same problem on every rank
    auto q_all = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
    auto k_all = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
    auto v_all = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
    auto do_all = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
    const std::vector<Chunk> chunks = layout_chunks(c, size, rank);

    // Whether this layout is neither zigzag's chunks nor the contiguous split on some rank.
    if (size > 1) {
      bool own = false;
      for (int r = 0; r < size; ++r) {
        const std::vector<Chunk> other = layout_chunks(c, size, r);
        const std::int64_t z = S / (2 * size);
        const bool contiguous = other.size() == 1 && other[0].start == r * Sl;
        const bool zigzag = (other.size() == 2 && other[0].start == r * z &&
                             other[1].start == (2 * size - 1 - r) * z) ||
                            (r == size - 1 && other.size() == 1 && other[0].start == r * z);
        own |= !contiguous && !zigzag;
      }
      own_layouts += own ? 1 : 0;
    }

    std::vector<double> q = take_rows(q_all, S, Hq, D, chunks),
                        k = take_rows(k_all, S, Hkv, D, chunks),
                        v = take_rows(v_all, S, Hkv, D, chunks),
                        dout = take_rows(do_all, S, Hq, D, chunks);
    ASSERT_EQ(static_cast<std::int64_t>(q.size()), B * Sl * Hq * D) << "the chunks hold S/N tokens";

    // The C API's ring.
    Results ring_out{ringattn::test::nan_vector<double>(q.size()),
                     ringattn::test::nan_vector<double>(B * Hq * Sl),
                     ringattn::test::nan_vector<double>(q.size()),
                     ringattn::test::nan_vector<double>(k.size()),
                     ringattn::test::nan_vector<double>(v.size())};
    const ringattn_ring_forward_params_t fp = ringattn::test::ring_forward_params(
        describe(q, {B, Sl, Hq, D}), describe(k, {B, Sl, Hkv, D}), describe(v, {B, Sl, Hkv, D}),
        describe(ring_out.o, {B, Sl, Hq, D}), describe(ring_out.lse, {B, Hq, Sl}), kScale,
        c.mask());
    ASSERT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    const ringattn_ring_backward_params_t bp = ringattn::test::ring_backward_params_of(
        fp, describe(dout, {B, Sl, Hq, D}), describe(ring_out.dq, {B, Sl, Hq, D}),
        describe(ring_out.dk, {B, Sl, Hkv, D}), describe(ring_out.dv, {B, Sl, Hkv, D}));
    ASSERT_EQ(ringattn_ring_backward(ring, &bp, nullptr), RINGATTN_SUCCESS)
        << ringattn_last_error();

    // The oracle on the whole sequence, its rows taken by the same chunks.
    const ringattn::Mask mask = c.mask();
    const ringattn::test::Outputs ref = ringattn::test::oracle_outputs(
        {B, S, S, Hq, Hkv, D}, view(q_all, {B, S, Hq, D}), view(k_all, {B, S, Hkv, D}),
        view(v_all, {B, S, Hkv, D}), view(do_all, {B, S, Hq, D}), mask, kScale);
    EXPECT_TRUE(ringattn::test::Close("O", ring_out.o, take_rows(ref.o, S, Hq, D, chunks), 1e-12));
    EXPECT_TRUE(ringattn::test::Close("LSE", ring_out.lse,
                                      take_rows(ref.lse, S, Hq, 1, chunks, true), 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dQ", ring_out.dq, take_rows(ref.dq, S, Hq, D, chunks), 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dK", ring_out.dk, take_rows(ref.dk, S, Hkv, D, chunks), 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dV", ring_out.dv, take_rows(ref.dv, S, Hkv, D, chunks), 1e-12));

    // The C++ balanced ring: its own shards of the same mask are the C API's, its outputs too.
    std::vector<double> q_cpp(q.size()), k_cpp(k.size()), v_cpp(v.size()), do_cpp(dout.size());
    cpp.shard(view(q_all, {B, S, Hq, D}), view(q_cpp, {B, Sl, Hq, D}), mask);
    cpp.shard(view(k_all, {B, S, Hkv, D}), view(k_cpp, {B, Sl, Hkv, D}), mask);
    cpp.shard(view(v_all, {B, S, Hkv, D}), view(v_cpp, {B, Sl, Hkv, D}), mask);
    cpp.shard(view(do_all, {B, S, Hq, D}), view(do_cpp, {B, Sl, Hq, D}), mask);
    EXPECT_EQ(q_cpp, q);
    EXPECT_EQ(k_cpp, k);
    EXPECT_EQ(v_cpp, v);
    EXPECT_EQ(do_cpp, dout);
    ringattn::test::OutputTensors<double> cpp_out({B, Sl, Sl, Hq, Hkv, D});
    ringattn::test::run_ring(cpp, view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}),
                             view(v, {B, Sl, Hkv, D}), view(dout, {B, Sl, Hq, D}), cpp_out, kScale,
                             mask);
    const ringattn::test::Outputs cc = cpp_out.values();
    EXPECT_EQ(ring_out.o, cc.o);
    EXPECT_EQ(ring_out.lse, cc.lse);
    EXPECT_EQ(ring_out.dq, cc.dq);
    EXPECT_EQ(ring_out.dk, cc.dk);
    EXPECT_EQ(ring_out.dv, cc.dv);
  }
  if (size > 1) {
    EXPECT_GE(own_layouts, 2) << "the masks gave zigzag's or the contiguous layout";
  }
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);
}

}  // namespace
