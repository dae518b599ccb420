// The HDF5 plumbing of the trainer's files (token datasets, checkpoints): an owner for HDF5
// identifiers, opening a file with a message that says what is wrong with it, and the few
// attribute helpers those files need. Every failure is a ringattn::Error naming the file.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace ringattn::train {

// Owns one HDF5 identifier and closes it with the matching H5?close. Move-only; the destructor
// never throws (a failed close there is ignored).
class Hdf5Id {
 public:
  using Close = herr_t (*)(hid_t);
  Hdf5Id() = default;
  Hdf5Id(hid_t id, Close close) noexcept : id_(id), close_(close) {}
  Hdf5Id(Hdf5Id&& other) noexcept : id_(other.id_), close_(other.close_) { other.id_ = -1; }
  Hdf5Id& operator=(Hdf5Id&& other) noexcept;
  Hdf5Id(const Hdf5Id&) = delete;
  Hdf5Id& operator=(const Hdf5Id&) = delete;
  ~Hdf5Id() { reset(); }

  hid_t get() const noexcept { return id_; }
  explicit operator bool() const noexcept { return id_ >= 0; }
  void reset() noexcept;
  // Gives up ownership, for a close whose status the caller checks.
  hid_t release() noexcept {
    const hid_t id = id_;
    id_ = -1;
    return id;
  }

 private:
  hid_t id_ = -1;
  Close close_ = nullptr;
};

// Turns off HDF5's printing of its error stack to stderr: the trainer reports errors itself.
void quiet_hdf5_errors();

// Opens an existing HDF5 file read-only. `what` names the kind of file in messages ("token
// dataset", "checkpoint"); `where` is the public function reporting. Throws ErrorKind::io when the
// file does not exist, is a directory, is not HDF5, or HDF5 cannot open it (truncated, corrupt).
Hdf5Id open_hdf5_file(const std::filesystem::path& path, std::string_view what,
                      std::string_view where);

// Creates (truncates) an HDF5 file in the 1.8+ format, whose metadata carries checksums.
Hdf5Id create_hdf5_file(const std::filesystem::path& path, std::string_view where);

// Elements [begin, begin + count) of a 1-D dataset, for one H5Dread or H5Dwrite: its file space
// with that range selected, and a memory space of `count` elements. `file` names the file in
// messages.
struct Hdf5Range {
  Hdf5Id file_space, memory_space;
};
Hdf5Range select_hdf5_range(hid_t dataset, std::int64_t begin, std::int64_t count,
                            const std::string& file);

// "uint16", "int32", "float32", "float64", "string", "compound", ...: for messages.
std::string describe_hdf5_type(hid_t type);

bool has_attribute(hid_t object, const char* name);
// The attribute's type class (H5T_INTEGER, H5T_STRING, ...); H5T_NO_CLASS when it is missing.
H5T_class_t attribute_class(hid_t object, const char* name);

// Writers: scalar attributes. `file` names the file in messages.
void write_attribute(hid_t object, const char* name, std::int64_t value, const std::string& file);
void write_attribute(hid_t object, const char* name, std::uint64_t value, const std::string& file);
void write_attribute(hid_t object, const char* name, std::string_view value,
                     const std::string& file);

// Readers of attributes whose class the caller has checked (H5T_INTEGER, H5T_STRING: fixed or
// variable length). HDF5 converts integer widths; a value outside the destination type fails.
std::int64_t read_int_attribute(hid_t object, const char* name, const std::string& file);
std::uint64_t read_uint_attribute(hid_t object, const char* name, const std::string& file);
std::string read_string_attribute(hid_t object, const char* name, const std::string& file);

}  // namespace ringattn::train
