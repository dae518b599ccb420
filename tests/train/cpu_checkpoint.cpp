// Checkpoints: a save/load round trip is bitwise (NaN payloads, -0, infinities, subnormals
// included) for tensors and state; a crash mid-save (a leftover .tmp) is invisible to loading and
// "latest"; only the newest K survive a save; truncated or bit-flipped files, missing tensors and
// shape mismatches give errors naming the file and the problem.
#include "train/checkpoint.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "tests/train/temp_dir.hpp"
#include "train/config.hpp"
#include "train/token_dataset_writer.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

struct Model {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<float>> values;

  std::vector<CheckpointTensor> to_save() const {
    std::vector<CheckpointTensor> tensors;
    for (std::size_t i = 0; i < names.size(); ++i) {
      tensors.push_back({names[i], shapes[i], values[i].data()});
    }
    return tensors;
  }
  // Slots for the same tensors, poisoned with NaN so that an unwritten element shows.
  std::vector<CheckpointTensorSlot> slots_into(std::vector<std::vector<float>>& out) const {
    out.clear();
    std::vector<CheckpointTensorSlot> slots;
    for (std::size_t i = 0; i < names.size(); ++i)
      out.push_back(test::nan_vector<float>(values[i].size()));
    for (std::size_t i = 0; i < names.size(); ++i)
      slots.push_back({names[i], shapes[i], out[i].data()});
    return slots;
  }
};

// Random parameters and moments of a few shapes, with every special float value somewhere.
Model random_model(std::mt19937_64& rng) {
  Model m;
  m.names = {"embedding", "layers.0.wq", "layers.0.norm", "adam_m.layers.0.wq", "scale", "empty"};
  m.shapes = {{64, 16}, {16, 24}, {16}, {16, 24}, {}, {0, 5}};
  for (const auto& shape : m.shapes) {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    m.values.push_back(test::normal_vector<float>(static_cast<std::size_t>(n), rng));
  }
  auto& w = m.values[1];
  w[0] = std::bit_cast<float>(0x7fc12345u);  // a NaN with a payload
  w[1] = -0.0f;
  w[2] = std::numeric_limits<float>::infinity();
  w[3] = -std::numeric_limits<float>::infinity();
  w[4] = std::numeric_limits<float>::denorm_min();
  w[5] = std::numeric_limits<float>::max();
  return m;
}

CheckpointState random_state(std::mt19937_64& rng, std::int64_t step) {
  CheckpointState state;
  state.step = step;
  for (int i = 0; i < 2500; ++i) state.rng_state.push_back(static_cast<std::uint8_t>(rng()));
  state.rng_state[0] = 0;  // bytes, not a C string
  state.data_position.sequences = rng();
  state.config_yaml = dump_config(TrainConfig{});
  return state;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { rng = test::make_rng(); }
  std::filesystem::path save(std::int64_t step, int keep = 100) {
    return save_checkpoint(dir.path(), random_state(rng, step), model.to_save(), keep);
  }

  test::TempDir dir;
  std::mt19937_64 rng;
  Model model = [] {
    std::mt19937_64 r = test::make_rng(7);
    return random_model(r);
  }();
};

TEST_F(CheckpointTest, RoundTripIsBitwise) {
  SCOPED_TRACE(test::seed_trace());
  const CheckpointState state = random_state(rng, 1234);
  const auto path = save_checkpoint(dir.path(), state, model.to_save(), 3);
  EXPECT_EQ(path, dir / "ckpt-1234.h5");
  std::vector<std::vector<float>> loaded;
  const CheckpointState back = load_checkpoint(path, model.slots_into(loaded));
  EXPECT_TRUE(back == state);
  for (std::size_t i = 0; i < model.names.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(loaded[i], model.values[i])) << model.names[i];
  }
  EXPECT_TRUE(read_checkpoint_state(path) == state);
  const auto infos = list_checkpoint_tensors(path);
  ASSERT_EQ(infos.size(), model.names.size());
  for (const auto& info : infos) {
    const auto at = std::find(model.names.begin(), model.names.end(), info.name);
    ASSERT_NE(at, model.names.end()) << info.name;
    EXPECT_EQ(info.shape, model.shapes[at - model.names.begin()]);
  }
  // The stored config is the run's config.
  EXPECT_TRUE(load_config_string(back.config_yaml, "<checkpoint>") == TrainConfig{});
}

TEST_F(CheckpointTest, LeftoverTemporaryFromACrashIsIgnoredThenDeleted) {
  SCOPED_TRACE(test::seed_trace());
  const auto good = save(100);
  // A crash while writing step 200: a partial file under the temporary name.
  const auto full = save(200);
  const auto bytes = std::filesystem::file_size(full);
  std::filesystem::rename(full, dir / "ckpt-200.h5.tmp");
  std::filesystem::resize_file(dir / "ckpt-200.h5.tmp", bytes / 2);

  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<std::int64_t>{100}));
  EXPECT_EQ(latest_checkpoint(dir.path()), good);
  EXPECT_EQ(resolve_resume(dir.path(), "latest"), good);
  std::vector<std::vector<float>> loaded;
  EXPECT_NO_THROW(load_checkpoint(*latest_checkpoint(dir.path()), model.slots_into(loaded)));

  save(300);
  EXPECT_FALSE(std::filesystem::exists(dir / "ckpt-200.h5.tmp")) << "the next save cleans up";
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().extension(), ".h5") << entry.path();
  }
}

TEST_F(CheckpointTest, KeepsTheNewestK) {
  for (const std::int64_t step : {8, 9, 10, 100, 20}) save(step, 3);
  // Numeric order, not text order: 100 is the newest, 9 < 10.
  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<std::int64_t>{10, 20, 100}));
  EXPECT_EQ(latest_checkpoint(dir.path()), dir / "ckpt-100.h5");
  save(101, 1);
  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<std::int64_t>{101}));
  // Files that only look like checkpoints are neither listed nor deleted.
  std::ofstream(dir / "ckpt-abc.h5") << "x";
  std::ofstream(dir / "notes.txt") << "x";
  save(102, 1);
  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<std::int64_t>{102}));
  EXPECT_TRUE(std::filesystem::exists(dir / "ckpt-abc.h5"));
  EXPECT_TRUE(std::filesystem::exists(dir / "notes.txt"));
}

TEST_F(CheckpointTest, TruncatedFileIsCorrupt) {
  const auto path = save(5);
  const auto bytes = std::filesystem::file_size(path);
  for (const std::uintmax_t keep : {bytes - 1, bytes / 2, std::uintmax_t{100}}) {
    SCOPED_TRACE(keep);
    const auto copy = dir / ("cut-" + std::to_string(keep) + ".h5");
    std::filesystem::copy_file(path, copy);
    std::filesystem::resize_file(copy, keep);
    std::vector<std::vector<float>> loaded;
    EXPECT_TRUE(throws_error_with(
        [&] { load_checkpoint(copy, model.slots_into(loaded)); },
        {"load_checkpoint: checkpoint '", copy.string(), "' is corrupt or truncated"},
        ErrorKind::io));
  }
}

// A flipped bit in a tensor's data: HDF5 reads it without complaint, the checksum does not.
TEST_F(CheckpointTest, FlippedBitInATensorFailsItsChecksum) {
  Model marked = model;
  for (std::size_t i = 0; i < marked.values[0].size(); ++i) marked.values[0][i] = 1000.0f + i;
  const auto path = save_checkpoint(dir.path(), random_state(rng, 1), marked.to_save(), 3);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const float probe[2] = {1000.0f + 500, 1000.0f + 501};
  const auto at = bytes.find(std::string(reinterpret_cast<const char*>(probe), sizeof probe));
  ASSERT_NE(at, std::string::npos) << "the tensor's bytes are stored as they are";
  bytes[at] ^= 0x01;
  std::ofstream(path, std::ios::binary) << bytes;
  std::vector<std::vector<float>> loaded;
  EXPECT_TRUE(throws_error_with([&] { load_checkpoint(path, marked.slots_into(loaded)); },
                                {path.string(),
                                 "is corrupt: its tensor 'embedding' does not match "
                                 "its checksum"},
                                ErrorKind::io));
}

TEST_F(CheckpointTest, MissingTensorShapeMismatchAndUnusedTensors) {
  const auto path = save(7);
  std::vector<std::vector<float>> loaded;
  std::vector<CheckpointTensorSlot> slots = model.slots_into(loaded);

  auto renamed = slots;
  renamed[1].name = "layers.0.wk";
  EXPECT_TRUE(throws_error_with([&] { load_checkpoint(path, renamed, UnusedTensors::ignore); },
                                {path.string(), "has no tensor 'layers.0.wk'"}, ErrorKind::io));

  auto reshaped = slots;
  reshaped[1].shape = {24, 16};
  EXPECT_TRUE(throws_error_with([&] { load_checkpoint(path, reshaped); },
                                {path.string(),
                                 "has tensor 'layers.0.wq' of shape [16, 24]; "
                                 "expected [24, 16]"}));

  const std::vector<CheckpointTensorSlot> fewer(slots.begin(), slots.begin() + 3);
  EXPECT_TRUE(throws_error_with([&] { load_checkpoint(path, fewer); },
                                {path.string(),
                                 "has tensor 'adam_m.layers.0.wq', which the model "
                                 "does not"}));
  EXPECT_NO_THROW(load_checkpoint(path, fewer, UnusedTensors::ignore));
  EXPECT_TRUE(bitwise_equal(loaded[0], model.values[0]));
}

TEST_F(CheckpointTest, FilesThatAreNotCheckpoints) {
  EXPECT_TRUE(throws_error_with([&] { read_checkpoint_state(dir / "ckpt-9.h5"); },
                                {"checkpoint '", "ckpt-9.h5' does not exist"}, ErrorKind::io));
  std::ofstream(dir / "text.h5") << "not hdf5";
  EXPECT_TRUE(throws_error_with([&] { read_checkpoint_state(dir / "text.h5"); },
                                {"text.h5' is not an HDF5 file"}, ErrorKind::io));
  write_token_dataset(dir / "tokens.h5", std::vector<std::int32_t>{1, 2, 3}, 256, "byte");
  EXPECT_TRUE(throws_error_with([&] { read_checkpoint_state(dir / "tokens.h5"); },
                                {"tokens.h5' is not a ringattn checkpoint"}, ErrorKind::io));
}

TEST_F(CheckpointTest, ResolveResume) {
  EXPECT_EQ(resolve_resume(dir.path(), ""), std::nullopt);
  EXPECT_EQ(resolve_resume(dir.path(), "latest"), std::nullopt) << "nothing saved yet";
  EXPECT_EQ(resolve_resume(dir / "never-created", "latest"), std::nullopt);
  const auto path = save(42);
  EXPECT_EQ(resolve_resume(dir.path(), "latest"), path);
  EXPECT_EQ(resolve_resume(dir.path(), path.string()), path);
  EXPECT_TRUE(throws_error_with(
      [&] { resolve_resume(dir.path(), "runs/x/ckpt-7.h5"); },
      {"run.resume is 'runs/x/ckpt-7.h5', which is not a checkpoint file"}, ErrorKind::io));
}

TEST_F(CheckpointTest, SaveRejectsBadTensorLists) {
  std::vector<CheckpointTensor> tensors = model.to_save();
  tensors[2].name = tensors[1].name;
  EXPECT_TRUE(throws_error_with([&] { save_checkpoint(dir.path(), {}, tensors, 1); },
                                {"tensor name 'layers.0.wq' is given twice"}));
  tensors = model.to_save();
  tensors[0].name = "layers/0";
  EXPECT_TRUE(throws_error_with([&] { save_checkpoint(dir.path(), {}, tensors, 1); },
                                {"tensor name 'layers/0' is empty or contains '/'"}));
  EXPECT_TRUE(throws_error_with([&] { save_checkpoint(dir.path(), {}, model.to_save(), 0); },
                                {"keep_last is 0; expected at least 1"}));
  EXPECT_TRUE(checkpoint_steps(dir.path()).empty()) << "nothing was written";
}

}  // namespace
}  // namespace ringattn::train
