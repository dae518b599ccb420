#include "train/checkpoint.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <set>

#include "ringattn/error.hpp"
#include "src/hdf5_check.hpp"
#include "train/atomic_file.hpp"
#include "train/counter_rng.hpp"
#include "train/hdf5_objects.hpp"

namespace ringattn::train {
namespace {

constexpr std::string_view kFormat = "ringattn-checkpoint";
constexpr std::int64_t kFormatVersion = 1;
constexpr const char* kTensorGroup = "tensors";

// A 64-bit checksum of a byte string: four independent SplitMix lanes over 8-byte words (so the
// multiplies overlap: about 1.5 GB/s on one core), folded together with the length. Not
// cryptographic; it catches torn writes and flipped bits.
std::uint64_t checksum64(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lanes[4] = {mix64(1), mix64(2), mix64(3), mix64(4)};
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      std::uint64_t word;
      std::memcpy(&word, p + i + 8 * lane, 8);
      lanes[lane] = mix64(lanes[lane] ^ word);
    }
  }
  std::uint64_t hash = mix64(bytes);
  for (const std::uint64_t lane : lanes) hash = mix64(hash ^ lane);
  for (; i < bytes; i += 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + i, std::min<std::size_t>(8, bytes - i));
    hash = mix64(hash ^ word);
  }
  return hash;
}

std::string shape_text(std::span<const std::int64_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text += (i == 0 ? "" : ", ") + std::to_string(shape[i]);
  }
  return text + "]";
}

std::int64_t element_count(std::span<const std::int64_t> shape) {
  std::int64_t count = 1;
  for (const std::int64_t d : shape) count *= d;
  return count;
}

// Step of "ckpt-<step>.h5" (and of "ckpt-<step>.h5.tmp" with suffix ".h5.tmp").
std::optional<std::int64_t> step_of(const std::string& filename, std::string_view suffix) {
  constexpr std::string_view prefix = "ckpt-";
  if (!filename.starts_with(prefix) || !filename.ends_with(suffix)) return std::nullopt;
  const std::string_view digits = std::string_view(filename).substr(
      prefix.size(), filename.size() - prefix.size() - suffix.size());
  std::int64_t step = -1;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size() || step < 0) {
    return std::nullopt;
  }
  return step;
}

// ---- writing ------------------------------------------------------------------------------------

void write_dataset(hid_t parent, const char* name, hid_t file_type, hid_t memory_type,
                   std::span<const hsize_t> dims, const void* data, std::size_t bytes,
                   const std::string& file) {
  const Hdf5Id space(
      RINGATTN_HDF5_CHECK(
          dims.empty() ? H5Screate(H5S_SCALAR)
                       : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
          file),
      H5Sclose);
  const Hdf5Id dataset(RINGATTN_HDF5_CHECK(H5Dcreate2(parent, name, file_type, space.get(),
                                                      H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                           file),
                       H5Dclose);
  if (bytes > 0) {
    RINGATTN_HDF5_CHECK(H5Dwrite(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
                        file);
  }
  write_attribute(dataset.get(), "checksum", checksum64(data, bytes), file);
}

void check_tensors_to_save(std::span<const CheckpointTensor> tensors) {
  std::set<std::string_view> names;
  for (const CheckpointTensor& t : tensors) {
    if (t.name.empty() || t.name.find('/') != std::string::npos) {
      detail::fail("save_checkpoint", "tensor name '", t.name,
                   "' is empty or contains '/'; use '.' to separate its parts");
    }
    if (!names.insert(t.name).second) {
      detail::fail("save_checkpoint", "tensor name '", t.name, "' is given twice");
    }
    if (std::any_of(t.shape.begin(), t.shape.end(), [](std::int64_t d) { return d < 0; })) {
      detail::fail("save_checkpoint", "tensor '", t.name, "' has shape ", shape_text(t.shape),
                   "; dimensions must be >= 0");
    }
    if (t.data == nullptr && element_count(t.shape) > 0) {
      detail::fail("save_checkpoint", "tensor '", t.name, "' has no data (null pointer)");
    }
  }
}

void write_checkpoint_file(const std::filesystem::path& path, const CheckpointState& state,
                           std::span<const CheckpointTensor> tensors) {
  const std::string name = path.string();
  const Hdf5Id file = create_hdf5_file(path, "save_checkpoint");
  write_attribute(file.get(), "format", kFormat, name);
  write_attribute(file.get(), "format_version", kFormatVersion, name);
  write_attribute(file.get(), "step", state.step, name);
  write_attribute(file.get(), "data_sequences", state.data_position.sequences, name);

  const Hdf5Id text_type(RINGATTN_HDF5_CHECK(H5Tcopy(H5T_C_S1), name), H5Tclose);
  RINGATTN_HDF5_CHECK(H5Tset_size(text_type.get(), state.config_yaml.size() + 1), name);
  write_dataset(file.get(), "config", text_type.get(), text_type.get(), {},
                state.config_yaml.c_str(), state.config_yaml.size() + 1, name);
  const hsize_t rng_bytes = state.rng_state.size();
  write_dataset(file.get(), "rng_state", H5T_STD_U8LE, H5T_NATIVE_UINT8,
                std::span<const hsize_t>(&rng_bytes, 1), state.rng_state.data(),
                state.rng_state.size(), name);

  const Hdf5Id group(
      RINGATTN_HDF5_CHECK(
          H5Gcreate2(file.get(), kTensorGroup, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), name),
      H5Gclose);
  for (const CheckpointTensor& t : tensors) {
    const std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
    write_dataset(group.get(), t.name.c_str(), H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, dims, t.data,
                  static_cast<std::size_t>(element_count(t.shape)) * sizeof(float), name);
  }
  RINGATTN_HDF5_CHECK(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), name);
}

void prune_checkpoints(const std::filesystem::path& dir, int keep_last) {
  const std::vector<std::int64_t> steps = checkpoint_steps(dir);
  std::vector<std::filesystem::path> doomed;
  for (std::size_t i = 0; i + keep_last < steps.size(); ++i) {
    doomed.push_back(checkpoint_path(dir, steps[i]));
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (step_of(entry.path().filename().string(), ".h5.tmp")) doomed.push_back(entry.path());
  }
  for (const auto& path : doomed) {
    std::error_code error;
    std::filesystem::remove(path, error);
    if (error) {
      detail::fail_as(ErrorKind::io, "save_checkpoint", "cannot delete old checkpoint '",
                      path.string(), "': ", error.message());
    }
  }
}

// ---- reading ------------------------------------------------------------------------------------

class CheckpointReader {
 public:
  CheckpointReader(const std::filesystem::path& path, const char* where)
      : name_(path.string()), where_(where), file_(open_hdf5_file(path, "checkpoint", where)) {
    if (attribute_class(file_.get(), "format") != H5T_STRING ||
        read_string_attribute(file_.get(), "format", name_) != kFormat) {
      fail("is not a ringattn checkpoint (no attribute format = \"", kFormat, "\")");
    }
    const std::int64_t version = read_int_attribute(file_.get(), "format_version", name_);
    if (version != kFormatVersion) {
      fail("has format_version ", version, "; this build reads version ", kFormatVersion);
    }
  }

  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    detail::fail_as(ErrorKind::io, where_, "checkpoint '", name_, "' ", parts...);
  }

  CheckpointState state() const {
    CheckpointState state;
    for (const char* attribute : {"step", "data_sequences"}) {
      if (attribute_class(file_.get(), attribute) != H5T_INTEGER) {
        fail("has no integer attribute '", attribute, "'");
      }
    }
    state.step = read_int_attribute(file_.get(), "step", name_);
    state.data_position.sequences = read_uint_attribute(file_.get(), "data_sequences", name_);

    const Hdf5Id config = open_dataset(file_.get(), "config", "dataset 'config'");
    const Hdf5Id config_type(RINGATTN_HDF5_CHECK(H5Dget_type(config.get()), name_), H5Tclose);
    if (H5Tget_class(config_type.get()) != H5T_STRING ||
        H5Tis_variable_str(config_type.get()) != 0) {
      fail("has a 'config' that is not a fixed-length string");
    }
    std::vector<char> text(H5Tget_size(config_type.get()), '\0');
    read_checked(config.get(), config_type.get(), text.data(), text.size(), "dataset 'config'");
    state.config_yaml.assign(text.data(), strnlen(text.data(), text.size()));

    const Hdf5Id rng = open_dataset(file_.get(), "rng_state", "dataset 'rng_state'");
    state.rng_state.resize(static_cast<std::size_t>(element_count(shape_of(rng.get()))));
    read_checked(rng.get(), H5T_NATIVE_UINT8, state.rng_state.data(), state.rng_state.size(),
                 "dataset 'rng_state'");
    return state;
  }

  std::vector<std::string> tensor_names() const {
    const Hdf5Id group = open_group();
    std::vector<std::string> names;
    auto collect = [](hid_t, const char* member, const H5L_info_t*, void* out) -> herr_t {
      static_cast<std::vector<std::string>*>(out)->emplace_back(member);
      return 0;
    };
    RINGATTN_HDF5_CHECK(
        H5Literate(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect, &names), name_);
    return names;
  }

  std::vector<std::int64_t> tensor_shape(const std::string& tensor) const {
    const Hdf5Id group = open_group();
    return shape_of(open_tensor(group.get(), tensor).get());
  }

  void read_tensor(const CheckpointTensorSlot& slot) const {
    const Hdf5Id group = open_group();
    const Hdf5Id dataset = open_tensor(group.get(), slot.name);
    const Hdf5Id type(RINGATTN_HDF5_CHECK(H5Dget_type(dataset.get()), name_), H5Tclose);
    if (describe_hdf5_type(type.get()) != "float32") {
      fail("has tensor '", slot.name, "' of type ", describe_hdf5_type(type.get()),
           "; expected float32");
    }
    const std::vector<std::int64_t> shape = shape_of(dataset.get());
    if (shape != slot.shape) {
      fail("has tensor '", slot.name, "' of shape ", shape_text(shape), "; expected ",
           shape_text(slot.shape));
    }
    if (slot.data == nullptr && element_count(shape) > 0) {
      detail::fail(where_, "slot for tensor '", slot.name, "' has no data (null pointer)");
    }
    read_checked(dataset.get(), H5T_NATIVE_FLOAT, slot.data,
                 static_cast<std::size_t>(element_count(shape)) * sizeof(float),
                 "tensor '" + slot.name + "'");
  }

 private:
  Hdf5Id open_dataset(hid_t parent, const char* name, const std::string& what) const {
    if (H5Lexists(parent, name, H5P_DEFAULT) <= 0) fail("has no ", what);
    const hid_t dataset = H5Dopen2(parent, name, H5P_DEFAULT);
    if (dataset < 0) {
      H5Eclear2(H5E_DEFAULT);
      fail("has a ", what, " that cannot be opened as a dataset (corrupt?)");
    }
    return Hdf5Id(dataset, H5Dclose);
  }

  Hdf5Id open_group() const {
    if (H5Lexists(file_.get(), kTensorGroup, H5P_DEFAULT) <= 0) fail("has no group 'tensors'");
    return Hdf5Id(RINGATTN_HDF5_CHECK(H5Gopen2(file_.get(), kTensorGroup, H5P_DEFAULT), name_),
                  H5Gclose);
  }

  Hdf5Id open_tensor(hid_t group, const std::string& tensor) const {
    if (H5Lexists(group, tensor.c_str(), H5P_DEFAULT) <= 0) fail("has no tensor '", tensor, "'");
    return open_dataset(group, tensor.c_str(), "tensor '" + tensor + "'");
  }

  std::vector<std::int64_t> shape_of(hid_t dataset) const {
    const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Dget_space(dataset), name_), H5Sclose);
    const int rank = RINGATTN_HDF5_CHECK(H5Sget_simple_extent_ndims(space.get()), name_);
    std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
    RINGATTN_HDF5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), name_);
    return std::vector<std::int64_t>(dims.begin(), dims.end());
  }

  // Reads `bytes` bytes of a whole dataset and checks them against its checksum attribute.
  void read_checked(hid_t dataset, hid_t memory_type, void* out, std::size_t bytes,
                    const std::string& what) const {
    if (bytes > 0) {
      if (H5Dread(dataset, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) {
        const std::string text = detail::hdf5_error_text();
        H5Eclear2(H5E_DEFAULT);
        fail("is corrupt: reading its ", what, " failed (", text, ")");
      }
    }
    if (attribute_class(dataset, "checksum") != H5T_INTEGER) fail("has no checksum for its ", what);
    if (read_uint_attribute(dataset, "checksum", name_) != checksum64(out, bytes)) {
      fail("is corrupt: its ", what, " does not match its checksum");
    }
  }

  std::string name_;
  const char* where_;
  Hdf5Id file_;
};

}  // namespace

std::filesystem::path checkpoint_path(const std::filesystem::path& dir, std::int64_t step) {
  return dir / ("ckpt-" + std::to_string(step) + ".h5");
}

std::filesystem::path save_checkpoint(const std::filesystem::path& dir,
                                      const CheckpointState& state,
                                      std::span<const CheckpointTensor> tensors, int keep_last) {
  if (state.step < 0) detail::fail("save_checkpoint", "step is ", state.step, "; expected >= 0");
  if (keep_last < 1) {
    detail::fail("save_checkpoint", "keep_last is ", keep_last, "; expected at least 1");
  }
  check_tensors_to_save(tensors);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    detail::fail_as(ErrorKind::io, "save_checkpoint", "cannot create directory '", dir.string(),
                    "': ", error.message());
  }
  const std::filesystem::path destination = checkpoint_path(dir, state.step);
  const std::filesystem::path temporary = destination.string() + ".tmp";
  try {
    write_checkpoint_file(temporary, state, tensors);
    publish_file(temporary, destination);
  } catch (...) {
    std::filesystem::remove(temporary, error);
    throw;
  }
  prune_checkpoints(dir, keep_last);
  return destination;
}

CheckpointState read_checkpoint_state(const std::filesystem::path& file) {
  return CheckpointReader(file, "read_checkpoint_state").state();
}

std::vector<CheckpointTensorInfo> list_checkpoint_tensors(const std::filesystem::path& file) {
  const CheckpointReader reader(file, "list_checkpoint_tensors");
  std::vector<CheckpointTensorInfo> infos;
  for (const std::string& name : reader.tensor_names()) {
    infos.push_back({name, reader.tensor_shape(name)});
  }
  return infos;
}

CheckpointState load_checkpoint(const std::filesystem::path& file,
                                std::span<const CheckpointTensorSlot> slots, UnusedTensors unused) {
  const CheckpointReader reader(file, "load_checkpoint");
  CheckpointState state = reader.state();
  if (unused == UnusedTensors::error) {
    std::set<std::string_view> wanted;
    for (const CheckpointTensorSlot& slot : slots) wanted.insert(slot.name);
    for (const std::string& name : reader.tensor_names()) {
      if (!wanted.contains(name)) {
        reader.fail("has tensor '", name, "', which the model does not (", slots.size(),
                    " tensors asked for; a checkpoint of a different model?)");
      }
    }
  }
  for (const CheckpointTensorSlot& slot : slots) reader.read_tensor(slot);
  return state;
}

std::vector<std::int64_t> checkpoint_steps(const std::filesystem::path& dir) {
  std::vector<std::int64_t> steps;
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) return steps;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (!entry.is_regular_file()) continue;
    if (const auto step = step_of(entry.path().filename().string(), ".h5")) {
      steps.push_back(*step);
    }
  }
  if (error) {
    detail::fail_as(ErrorKind::io, "checkpoint_steps", "cannot list '", dir.string(),
                    "': ", error.message());
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir) {
  const std::vector<std::int64_t> steps = checkpoint_steps(dir);
  if (steps.empty()) return std::nullopt;
  return checkpoint_path(dir, steps.back());
}

std::optional<std::filesystem::path> resolve_resume(const std::filesystem::path& dir,
                                                    std::string_view resume) {
  if (resume.empty()) return std::nullopt;
  if (resume == "latest") return latest_checkpoint(dir);
  const std::filesystem::path path(resume);
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    detail::fail_as(ErrorKind::io, "resolve_resume", "run.resume is '", resume,
                    "', which is not a checkpoint file (expected \"\", \"latest\" or the path "
                    "of a ckpt-<step>.h5)");
  }
  return path;
}

}  // namespace ringattn::train
