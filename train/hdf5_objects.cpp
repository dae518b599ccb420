#include "train/hdf5_objects.hpp"

#include <memory>
#include <vector>

#include "ringattn/error.hpp"
#include "src/hdf5_check.hpp"

namespace ringattn::train {

Hdf5Id& Hdf5Id::operator=(Hdf5Id&& other) noexcept {
  if (this != &other) {
    reset();
    id_ = other.id_;
    close_ = other.close_;
    other.id_ = -1;
  }
  return *this;
}

void Hdf5Id::reset() noexcept {
  if (id_ >= 0 && close_ != nullptr) close_(id_);
  id_ = -1;
}

void quiet_hdf5_errors() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

Hdf5Id open_hdf5_file(const std::filesystem::path& path, std::string_view what,
                      std::string_view where) {
  quiet_hdf5_errors();
  const std::string name = path.string();
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (!std::filesystem::exists(status)) {
    detail::fail_as(ErrorKind::io, where, what, " '", name, "' does not exist");
  }
  if (std::filesystem::is_directory(status)) {
    detail::fail_as(ErrorKind::io, where, what, " '", name,
                    "' is a directory; expected an HDF5 file");
  }
  const htri_t is_hdf5 = H5Fis_hdf5(name.c_str());
  if (is_hdf5 < 0) {
    const std::string text = detail::hdf5_error_text();
    H5Eclear2(H5E_DEFAULT);
    detail::fail_as(ErrorKind::io, where, what, " '", name, "' could not be read",
                    text.empty() ? "" : ": ", text);
  }
  if (is_hdf5 == 0) {
    detail::fail_as(ErrorKind::io, where, what, " '", name, "' is not an HDF5 file (",
                    std::filesystem::file_size(path, error), " bytes without the HDF5 signature)");
  }
  const hid_t file = H5Fopen(name.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) {
    const std::string text = detail::hdf5_error_text();
    H5Eclear2(H5E_DEFAULT);
    detail::fail_as(ErrorKind::io, where, what, " '", name,
                    "' is corrupt or truncated: HDF5 cannot open it", text.empty() ? "" : " (",
                    text, text.empty() ? "" : ")");
  }
  return Hdf5Id(file, H5Fclose);
}

Hdf5Range select_hdf5_range(hid_t dataset, std::int64_t begin, std::int64_t count,
                            const std::string& file) {
  Hdf5Range range;
  range.file_space = Hdf5Id(RINGATTN_HDF5_CHECK(H5Dget_space(dataset), file), H5Sclose);
  const hsize_t start = static_cast<hsize_t>(begin), size = static_cast<hsize_t>(count);
  RINGATTN_HDF5_CHECK(H5Sselect_hyperslab(range.file_space.get(), H5S_SELECT_SET, &start, nullptr,
                                          &size, nullptr),
                      file);
  range.memory_space = Hdf5Id(RINGATTN_HDF5_CHECK(H5Screate_simple(1, &size, nullptr), file),
                              H5Sclose);
  return range;
}

Hdf5Id create_hdf5_file(const std::filesystem::path& path, std::string_view where) {
  quiet_hdf5_errors();
  const std::string name = path.string();
  const Hdf5Id access(RINGATTN_HDF5_CHECK(H5Pcreate(H5P_FILE_ACCESS), name), H5Pclose);
  RINGATTN_HDF5_CHECK(H5Pset_libver_bounds(access.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST), name);
  const hid_t file = H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, access.get());
  if (file < 0) {
    const std::string text = detail::hdf5_error_text();
    H5Eclear2(H5E_DEFAULT);
    detail::fail_as(ErrorKind::io, where, "cannot create '", name, "'", text.empty() ? "" : ": ",
                    text);
  }
  return Hdf5Id(file, H5Fclose);
}

std::string describe_hdf5_type(hid_t type) {
  const std::string bits = std::to_string(8 * H5Tget_size(type));
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + bits;
    case H5T_FLOAT:
      return "float" + bits;
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ENUM:
      return "enum";
    case H5T_ARRAY:
      return "array";
    case H5T_VLEN:
      return "variable-length sequence";
    case H5T_OPAQUE:
      return "opaque";
    case H5T_BITFIELD:
      return "bitfield";
    case H5T_REFERENCE:
      return "reference";
    default:
      return "unknown type";
  }
}

bool has_attribute(hid_t object, const char* name) {
  return H5Aexists(object, name) > 0;
}

H5T_class_t attribute_class(hid_t object, const char* name) {
  if (!has_attribute(object, name)) return H5T_NO_CLASS;
  const Hdf5Id attribute(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  if (!attribute) return H5T_NO_CLASS;
  const Hdf5Id type(H5Aget_type(attribute.get()), H5Tclose);
  return type ? H5Tget_class(type.get()) : H5T_NO_CLASS;
}

namespace {

void write_scalar_attribute(hid_t object, const char* name, hid_t file_type, hid_t memory_type,
                            const void* value, const std::string& file) {
  const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Screate(H5S_SCALAR), file), H5Sclose);
  const Hdf5Id attribute(
      RINGATTN_HDF5_CHECK(
          H5Acreate2(object, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), file),
      H5Aclose);
  RINGATTN_HDF5_CHECK(H5Awrite(attribute.get(), memory_type, value), file);
}

template <typename T>
T read_scalar_attribute(hid_t object, const char* name, hid_t memory_type,
                        const std::string& file) {
  const Hdf5Id attribute(RINGATTN_HDF5_CHECK(H5Aopen(object, name, H5P_DEFAULT), file), H5Aclose);
  const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Aget_space(attribute.get()), file), H5Sclose);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) {
    detail::fail_as(ErrorKind::io, "read_attribute", "attribute '", name, "' in '", file,
                    "' holds ", H5Sget_simple_extent_npoints(space.get()), " values; expected one");
  }
  T value{};
  RINGATTN_HDF5_CHECK(H5Aread(attribute.get(), memory_type, &value), file);
  return value;
}

}  // namespace

void write_attribute(hid_t object, const char* name, std::int64_t value, const std::string& file) {
  write_scalar_attribute(object, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value, file);
}

void write_attribute(hid_t object, const char* name, std::uint64_t value, const std::string& file) {
  write_scalar_attribute(object, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value, file);
}

void write_attribute(hid_t object, const char* name, std::string_view value,
                     const std::string& file) {
  // Fixed length, NUL-terminated: h5dump, h5py and this reader all read it as text.
  const Hdf5Id type(RINGATTN_HDF5_CHECK(H5Tcopy(H5T_C_S1), file), H5Tclose);
  RINGATTN_HDF5_CHECK(H5Tset_size(type.get(), value.size() + 1), file);
  RINGATTN_HDF5_CHECK(H5Tset_strpad(type.get(), H5T_STR_NULLTERM), file);
  const std::string text(value);
  write_scalar_attribute(object, name, type.get(), type.get(), text.c_str(), file);
}

std::int64_t read_int_attribute(hid_t object, const char* name, const std::string& file) {
  return read_scalar_attribute<std::int64_t>(object, name, H5T_NATIVE_INT64, file);
}

std::uint64_t read_uint_attribute(hid_t object, const char* name, const std::string& file) {
  return read_scalar_attribute<std::uint64_t>(object, name, H5T_NATIVE_UINT64, file);
}

std::string read_string_attribute(hid_t object, const char* name, const std::string& file) {
  const Hdf5Id attribute(RINGATTN_HDF5_CHECK(H5Aopen(object, name, H5P_DEFAULT), file), H5Aclose);
  const Hdf5Id type(RINGATTN_HDF5_CHECK(H5Aget_type(attribute.get()), file), H5Tclose);
  const htri_t variable = RINGATTN_HDF5_CHECK(H5Tis_variable_str(type.get()), file);
  if (variable > 0) {
    const Hdf5Id memory(RINGATTN_HDF5_CHECK(H5Tcopy(H5T_C_S1), file), H5Tclose);
    RINGATTN_HDF5_CHECK(H5Tset_size(memory.get(), H5T_VARIABLE), file);
    char* text = nullptr;
    RINGATTN_HDF5_CHECK(H5Aread(attribute.get(), memory.get(), &text), file);
    std::string value = text != nullptr ? text : "";
    H5free_memory(text);
    return value;
  }
  const std::size_t size = H5Tget_size(type.get());
  std::vector<char> buffer(size + 1, '\0');
  RINGATTN_HDF5_CHECK(H5Aread(attribute.get(), type.get(), buffer.data()), file);
  return std::string(buffer.data());  // up to the first NUL (NULLTERM and NULLPAD alike)
}

}  // namespace ringattn::train
