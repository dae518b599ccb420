#include "train/token_dataset_writer.hpp"

#include <algorithm>
#include <vector>

#include "ringattn/error.hpp"
#include "src/hdf5_check.hpp"
#include "train/atomic_file.hpp"

namespace ringattn::train {
namespace {

constexpr const char* kWhere = "TokenDatasetWriter";

}  // namespace

TokenDatasetWriter::TokenDatasetWriter(const std::filesystem::path& path, std::int64_t num_tokens,
                                       int vocab_size, const std::string& tokenizer)
    : path_(path),
      temporary_(path.string() + ".tmp"),
      name_(path.string()),
      num_tokens_(num_tokens),
      vocab_size_(vocab_size) {
  if (num_tokens < 0) detail::fail(kWhere, "num_tokens is ", num_tokens, "; expected >= 0");
  if (vocab_size < 1) detail::fail(kWhere, "vocab_size is ", vocab_size, "; expected >= 1");
  file_ = create_hdf5_file(temporary_, kWhere);
  const hid_t type = vocab_size <= (1 << 16) ? H5T_STD_U16LE : H5T_STD_U32LE;
  const hsize_t size = static_cast<hsize_t>(num_tokens);
  const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Screate_simple(1, &size, nullptr), name_), H5Sclose);
  tokens_ = Hdf5Id(RINGATTN_HDF5_CHECK(H5Dcreate2(file_.get(), "tokens", type, space.get(),
                                                  H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                       name_),
                   H5Dclose);
  write_attribute(tokens_.get(), "vocab_size", std::int64_t{vocab_size}, name_);
  write_attribute(tokens_.get(), "tokenizer", tokenizer, name_);
}

TokenDatasetWriter::~TokenDatasetWriter() {
  if (finished_) return;
  tokens_.reset();
  file_.reset();
  std::error_code ignored;
  std::filesystem::remove(temporary_, ignored);
}

void TokenDatasetWriter::append(std::span<const std::int32_t> tokens) {
  const auto count = static_cast<std::int64_t>(tokens.size());
  if (written_ + count > num_tokens_) {
    detail::fail(kWhere, "'", name_, "': appending ", count, " tokens after ", written_,
                 " would pass the ", num_tokens_, " the dataset was created for");
  }
  if (count == 0) return;
  std::vector<std::uint32_t> values(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size_) {
      detail::fail(kWhere, "'", name_, "': token ", tokens[i], " at position ",
                   written_ + static_cast<std::int64_t>(i), " is outside the vocabulary [0, ",
                   vocab_size_, ")");
    }
    values[i] = static_cast<std::uint32_t>(tokens[i]);
  }
  const Hdf5Range range = select_hdf5_range(tokens_.get(), written_, count, name_);
  RINGATTN_HDF5_CHECK(H5Dwrite(tokens_.get(), H5T_NATIVE_UINT32, range.memory_space.get(),
                               range.file_space.get(), H5P_DEFAULT, values.data()),
                      name_);
  if (end_token_ >= 0) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] == end_token_) add_start(written_ + static_cast<std::int64_t>(i) + 1);
    }
  }
  written_ += count;
}

void TokenDatasetWriter::add_start(std::int64_t token) {
  documents_ = true;
  if (starts_.empty() || starts_.back() < token) starts_.push_back(token);
}

void TokenDatasetWriter::start_document() {
  add_start(written_);
}

void TokenDatasetWriter::end_documents_at(std::int32_t token) {
  if (token < 0 || token >= vocab_size_) {
    detail::fail(kWhere, "'", name_, "': end-of-document token ", token,
                 " is outside the vocabulary [0, ", vocab_size_, ")");
  }
  documents_ = true;
  end_token_ = token;
}

void TokenDatasetWriter::finish() {
  if (written_ != num_tokens_) {
    detail::fail(kWhere, "'", name_, "': finish() after ", written_, " of ", num_tokens_,
                 " tokens");
  }
  tokens_.reset();
  if (documents_) {
    // A start at the end of the stream (after a final end-of-document token) begins nothing.
    while (!starts_.empty() && starts_.back() >= num_tokens_) starts_.pop_back();
    const hsize_t size = starts_.size();
    const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Screate_simple(1, &size, nullptr), name_), H5Sclose);
    const Hdf5Id starts(RINGATTN_HDF5_CHECK(H5Dcreate2(file_.get(), "document_starts",
                                                       H5T_STD_I64LE, space.get(), H5P_DEFAULT,
                                                       H5P_DEFAULT, H5P_DEFAULT),
                                            name_),
                        H5Dclose);
    if (size > 0) {
      RINGATTN_HDF5_CHECK(H5Dwrite(starts.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                   starts_.data()),
                          name_);
    }
  }
  RINGATTN_HDF5_CHECK(H5Fclose(file_.release()), name_);
  publish_file(temporary_, path_);
  finished_ = true;
}

void write_token_dataset(const std::filesystem::path& path, std::span<const std::int32_t> tokens,
                         int vocab_size, const std::string& tokenizer,
                         std::span<const std::int64_t> document_starts) {
  TokenDatasetWriter writer(path, static_cast<std::int64_t>(tokens.size()), vocab_size, tokenizer);
  std::size_t next = 0;
  for (std::size_t i = 0; i < document_starts.size(); ++i) {
    const auto start = static_cast<std::size_t>(
        std::clamp<std::int64_t>(document_starts[i], 0, static_cast<std::int64_t>(tokens.size())));
    if (start < next) {
      detail::fail(kWhere, "'", path.string(), "': document_starts[", i, "] is ",
                   document_starts[i], "; expected sorted offsets");
    }
    writer.append(tokens.subspan(next, start - next));
    writer.start_document();
    next = start;
  }
  writer.append(tokens.subspan(next));
  writer.finish();
}

}  // namespace ringattn::train
