// Checkpoints: everything a run needs to continue bit for bit, in one HDF5 file per step.
//
//   <dir>/ckpt-<step>.h5
//     attributes  format = "ringattn-checkpoint", format_version = 1, step (int64),
//                 data_sequences (uint64: DataPosition::sequences)
//     /config     string: the run's config as YAML (dump_config)
//     /rng_state  uint8[n]: the caller's random generator state, opaque here
//     /tensors/<name>  float32 of the tensor's shape: parameters and optimizer moments, named
//                      by the caller ("layers.0.wq", "adam_m.layers.0.wq", ...)
//   every dataset carries a 64-bit checksum of its bytes (attribute `checksum`), checked on load.
//
// Tensors are whole (every rank holds all parameters), so a checkpoint loads under any dp x cp
// layout. A save is atomic: the file is written as ckpt-<step>.h5.tmp, synced, renamed, and the
// directory synced; a crash leaves at most a .tmp, which loading and "latest" ignore and the next
// save deletes. After a save only the newest `keep_last` checkpoints remain.
//
// Every failure is a ringattn::Error (ErrorKind::io for file problems) naming the file and what is
// wrong: missing, not HDF5, truncated or corrupt, not a checkpoint, a missing tensor, a shape
// mismatch, a failed checksum.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "train/sequence_sampler.hpp"

namespace ringattn::train {

// A host tensor to save: `shape` (row-major, any rank, 0 for a scalar) elements at `data`.
struct CheckpointTensor {
  std::string name;  // non-empty, unique, no '/'
  std::vector<std::int64_t> shape;
  const float* data = nullptr;
};

// Where a loaded tensor goes: the checkpoint's tensor `name` must have exactly `shape`.
struct CheckpointTensorSlot {
  std::string name;
  std::vector<std::int64_t> shape;
  float* data = nullptr;
};

struct CheckpointTensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;
};

// Everything but the tensors.
struct CheckpointState {
  std::int64_t step = 0;  // optimizer steps completed
  std::vector<std::uint8_t> rng_state;
  DataPosition data_position;
  std::string config_yaml;

  friend bool operator==(const CheckpointState&, const CheckpointState&) = default;
};

// <dir>/ckpt-<step>.h5
std::filesystem::path checkpoint_path(const std::filesystem::path& dir, std::int64_t step);

// Writes the checkpoint of state.step into `dir` (created if needed) atomically, then deletes all
// but the newest keep_last >= 1 checkpoints and any stale .tmp. Returns the file's path.
std::filesystem::path save_checkpoint(const std::filesystem::path& dir,
                                      const CheckpointState& state,
                                      std::span<const CheckpointTensor> tensors, int keep_last);

// What a checkpoint file holds, without reading its tensors.
CheckpointState read_checkpoint_state(const std::filesystem::path& file);
std::vector<CheckpointTensorInfo> list_checkpoint_tensors(const std::filesystem::path& file);

// What to do with tensors in the file that no slot asks for: by default an error (the model does
// not match the checkpoint); `ignore` loads a subset (e.g. parameters without optimizer state).
enum class UnusedTensors { error, ignore };

// Fills every slot from the file (shapes must match exactly) and returns the rest of the state.
CheckpointState load_checkpoint(const std::filesystem::path& file,
                                std::span<const CheckpointTensorSlot> slots,
                                UnusedTensors unused = UnusedTensors::error);

// The steps of the complete checkpoints in `dir` (ckpt-<step>.h5; .tmp files are not), ascending;
// empty when there are none or `dir` does not exist.
std::vector<std::int64_t> checkpoint_steps(const std::filesystem::path& dir);
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir);

// The checkpoint a run resumes from, by run.resume: "" none; "latest" the newest in `dir` (none
// when there is none yet, so a job can be restarted with the same command); anything else a
// path, which must exist.
std::optional<std::filesystem::path> resolve_resume(const std::filesystem::path& dir,
                                                    std::string_view resume);

}  // namespace ringattn::train
