#include "train/token_dataset.hpp"

#include <algorithm>
#include <system_error>
#include <vector>

#include "ringattn/error.hpp"
#include "src/hdf5_check.hpp"
#include "train/digest.hpp"
#include "train/documents.hpp"

namespace ringattn::train {
namespace {

constexpr const char* kWhere = "TokenDataset";

// The identity reads the file in pieces of this many tokens: 8 MiB (uint16) or 16 MiB (uint32)
// of buffer, large enough that HDF5's per-read cost vanishes beside the copy.
constexpr std::int64_t kIdentityChunkTokens = std::int64_t{1} << 22;

template <typename... Parts>
[[noreturn]] void fail_file(const std::string& file, const Parts&... parts) {
  detail::fail_as(ErrorKind::io, kWhere, "token dataset '", file, "': ", parts...);
}

// Tokens [begin, begin + count) of the 1-D dataset `tokens` into `out`, as `memory_type` (HDF5
// converts from the file's type on the way where they differ).
void read_token_range(hid_t tokens, const std::string& file, std::int64_t begin,
                      std::int64_t count, hid_t memory_type, void* out) {
  const Hdf5Range range = select_hdf5_range(tokens, begin, count, file);
  RINGATTN_HDF5_CHECK(H5Dread(tokens, memory_type, range.memory_space.get(),
                              range.file_space.get(), H5P_DEFAULT, out),
                      file);
}

// Error naming the first token of `tokens` (the file's tokens from position `begin`) that is not
// below vocab_size; returns where all are. The largest is found first: a reduction the compiler
// vectorises, where a test and branch per token would not be.
template <typename T>
void check_vocabulary(const std::string& file, std::span<const T> tokens, std::int64_t begin,
                      int vocab_size) {
  T largest = 0;
  for (const T token : tokens) largest = std::max(largest, token);
  const auto limit = static_cast<std::uint64_t>(vocab_size);
  if (largest < limit) return;
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [&](T t) { return t >= limit; });
  fail_file(file, "token ", *bad, " at position ", begin + (bad - tokens.begin()),
            " is outside the vocabulary [0, ", vocab_size, ")");
}

// Every token of the dataset, read in chunks of its own type T (no conversion), checked against
// the vocabulary and added to `digest`.
template <typename T>
void digest_all_tokens(hid_t tokens, const std::string& file, std::int64_t num_tokens,
                       int vocab_size, hid_t memory_type, Digest& digest) {
  std::vector<T> chunk(static_cast<std::size_t>(std::min(kIdentityChunkTokens, num_tokens)));
  for (std::int64_t begin = 0; begin < num_tokens; begin += kIdentityChunkTokens) {
    const std::int64_t count = std::min(kIdentityChunkTokens, num_tokens - begin);
    const std::span<const T> part(chunk.data(), static_cast<std::size_t>(count));
    read_token_range(tokens, file, begin, count, memory_type, chunk.data());
    check_vocabulary(file, part, begin, vocab_size);
    digest.add(part.data(), part.size_bytes());
  }
}

}  // namespace

TokenDataset::TokenDataset(const std::filesystem::path& path, int model_vocab_size,
                           std::int64_t seq_len)
    : path_(path), name_(path.string()), seq_len_(seq_len) {
  if (seq_len < 1) detail::fail(kWhere, "seq_len is ", seq_len, "; expected at least 1");
  file_ = open_hdf5_file(path, "token dataset", kWhere);

  if (H5Lexists(file_.get(), "tokens", H5P_DEFAULT) <= 0) {
    fail_file(name_, "no dataset 'tokens' (expected a 1-D uint16 or uint32 array of token ids)");
  }
  tokens_ = Hdf5Id(H5Dopen2(file_.get(), "tokens", H5P_DEFAULT), H5Dclose);
  if (!tokens_) {
    H5Eclear2(H5E_DEFAULT);
    fail_file(name_, "'tokens' is not a dataset (expected a 1-D uint16 or uint32 array)");
  }

  const Hdf5Id type(RINGATTN_HDF5_CHECK(H5Dget_type(tokens_.get()), name_), H5Tclose);
  token_type_ = describe_hdf5_type(type.get());
  if (token_type_ != "uint16" && token_type_ != "uint32") {
    fail_file(name_, "'tokens' has type ", token_type_, "; expected uint16 or uint32");
  }
  const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Dget_space(tokens_.get()), name_), H5Sclose);
  const int rank = RINGATTN_HDF5_CHECK(H5Sget_simple_extent_ndims(space.get()), name_);
  if (rank != 1) {
    std::vector<hsize_t> dims(rank);
    H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    std::string shape;
    for (const hsize_t d : dims) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    fail_file(name_, "'tokens' has ", rank, " dimensions [", shape, "]; expected 1");
  }
  hsize_t size = 0;
  H5Sget_simple_extent_dims(space.get(), &size, nullptr);
  num_tokens_ = static_cast<std::int64_t>(size);

  const H5T_class_t vocab_class = attribute_class(tokens_.get(), "vocab_size");
  if (vocab_class == H5T_NO_CLASS) {
    fail_file(name_, "'tokens' has no attribute 'vocab_size' (expected an integer)");
  }
  if (vocab_class != H5T_INTEGER) {
    fail_file(name_, "attribute 'vocab_size' of 'tokens' is not an integer");
  }
  const std::int64_t vocab = read_int_attribute(tokens_.get(), "vocab_size", name_);
  const std::int64_t type_limit =
      token_type_ == "uint16" ? std::int64_t{1} << 16 : std::int64_t{1} << 31;
  if (vocab < 1 || vocab > type_limit) {
    fail_file(name_, "attribute 'vocab_size' is ", vocab, "; expected 1 to ", type_limit, " for ",
              token_type_, " tokens");
  }
  vocab_size_ = static_cast<int>(vocab);

  const H5T_class_t tokenizer_class = attribute_class(tokens_.get(), "tokenizer");
  if (tokenizer_class == H5T_NO_CLASS) {
    fail_file(name_, "'tokens' has no attribute 'tokenizer' (expected a string such as \"byte\")");
  }
  if (tokenizer_class != H5T_STRING) {
    fail_file(name_, "attribute 'tokenizer' of 'tokens' is not a string");
  }
  tokenizer_ = read_string_attribute(tokens_.get(), "tokenizer", name_);

  if (vocab_size_ > model_vocab_size) {
    detail::fail(kWhere, "token dataset '", name_, "' has vocab_size ", vocab_size_,
                 " (tokenizer '", tokenizer_, "'), more than model.vocab_size ", model_vocab_size);
  }
  read_document_starts();
  if (num_tokens_ < seq_len + 1) {
    detail::fail(kWhere, "token dataset '", name_, "' holds ", num_tokens_,
                 " tokens; one sequence of train.seq_len = ", seq_len, " needs ", seq_len + 1);
  }
}

void TokenDataset::read_document_starts() {
  if (H5Lexists(file_.get(), "document_starts", H5P_DEFAULT) <= 0) return;
  const Hdf5Id starts(H5Dopen2(file_.get(), "document_starts", H5P_DEFAULT), H5Dclose);
  if (!starts) {
    H5Eclear2(H5E_DEFAULT);
    fail_file(name_, "'document_starts' is not a dataset (expected a 1-D integer array)");
  }
  const Hdf5Id type(RINGATTN_HDF5_CHECK(H5Dget_type(starts.get()), name_), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_INTEGER) {
    fail_file(name_, "'document_starts' has type ", describe_hdf5_type(type.get()),
              "; expected integers (token offsets)");
  }
  const Hdf5Id space(RINGATTN_HDF5_CHECK(H5Dget_space(starts.get()), name_), H5Sclose);
  const int rank = RINGATTN_HDF5_CHECK(H5Sget_simple_extent_ndims(space.get()), name_);
  if (rank != 1) fail_file(name_, "'document_starts' has ", rank, " dimensions; expected 1");
  hsize_t size = 0;
  H5Sget_simple_extent_dims(space.get(), &size, nullptr);
  document_starts_.resize(static_cast<std::size_t>(size));
  if (size > 0) {
    RINGATTN_HDF5_CHECK(H5Dread(starts.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                document_starts_.data()),
                        name_);
  }
  for (std::size_t i = 0; i < document_starts_.size(); ++i) {
    const std::int64_t start = document_starts_[i];
    if (start < 0 || start >= num_tokens_) {
      fail_file(name_, "document_starts[", i, "] is ", start, "; expected a token offset in [0, ",
                num_tokens_, ")");
    }
    if (i > 0 && start <= document_starts_[i - 1]) {
      fail_file(name_, "document_starts[", i, "] is ", start, " after ", document_starts_[i - 1],
                "; expected increasing offsets");
    }
  }
  has_documents_ = true;
}

std::string TokenDataset::identity() const {
  Digest digest;
  if (token_type_ == "uint16") {
    digest_all_tokens<std::uint16_t>(tokens_.get(), name_, num_tokens_, vocab_size_,
                                     H5T_NATIVE_UINT16, digest);
  } else {
    digest_all_tokens<std::uint32_t>(tokens_.get(), name_, num_tokens_, vocab_size_,
                                     H5T_NATIVE_UINT32, digest);
  }
  std::string documents;
  if (has_documents_) {
    digest.add(document_starts_.data(), document_starts_.size() * sizeof(std::int64_t));
    documents = ", " + std::to_string(document_starts_.size()) + " document starts";
  }
  std::error_code error;
  const std::uintmax_t bytes = std::filesystem::file_size(path_, error);
  return std::to_string(num_tokens_) + " tokens, vocab " + std::to_string(vocab_size_) +
         ", tokenizer " + tokenizer_ + ", " + token_type_ + ", " +
         (error ? std::string("size unknown") : std::to_string(bytes) + " bytes") + documents +
         ", digest " + digest.hex();
}

void TokenDataset::read_tokens(std::int64_t begin, std::span<std::int32_t> out) const {
  const auto count = static_cast<std::int64_t>(out.size());
  if (begin < 0 || begin + count > num_tokens_) {
    detail::fail(kWhere, "read of tokens [", begin, ", ", begin + count, ") of '", name_,
                 "', which holds ", num_tokens_);
  }
  if (count == 0) return;
  // HDF5 widens uint16 to uint32 on the way; the values then fit int32 (vocab_size <= 2^31).
  std::vector<std::uint32_t> raw(out.size());
  read_token_range(tokens_.get(), name_, begin, count, H5T_NATIVE_UINT32, raw.data());
  check_vocabulary(name_, std::span<const std::uint32_t>(raw), begin, vocab_size_);
  std::copy(raw.begin(), raw.end(), out.begin());
}

std::vector<std::int64_t> TokenDataset::sequence_document_starts(std::int64_t sequence) const {
  if (sequence < 0 || sequence >= num_sequences()) {
    detail::fail(kWhere, "sequence ", sequence, " of '", name_, "' does not exist; it has ",
                 num_sequences(), " of train.seq_len = ", seq_len_);
  }
  return window_document_starts(document_starts_, sequence * seq_len_, seq_len_);
}

TokenShard TokenDataset::read_shard(std::int64_t sequence, std::span<const TokenRange> ranges,
                                    bool documents) const {
  if (sequence < 0 || sequence >= num_sequences()) {
    detail::fail(kWhere, "sequence ", sequence, " of '", name_, "' does not exist; it has ",
                 num_sequences(), " of train.seq_len = ", seq_len_);
  }
  const std::int64_t start = sequence * seq_len_;
  TokenShard shard;
  std::vector<std::int32_t> window;
  for (const TokenRange& range : ranges) {
    if (range.begin < 0 || range.end > seq_len_ || range.begin >= range.end) {
      detail::fail(kWhere, "range [", range.begin, ", ", range.end,
                   ") is not a non-empty part of a sequence of ", seq_len_, " tokens");
    }
    window.resize(static_cast<std::size_t>(range.size() + 1));
    read_tokens(start + range.begin, window);
    shard.inputs.insert(shard.inputs.end(), window.begin(), window.end() - 1);
    shard.targets.insert(shard.targets.end(), window.begin() + 1, window.end());
  }
  shard.loss_mask.assign(shard.inputs.size(), 1.0f);
  if (documents) {
    shard.document_starts = sequence_document_starts(sequence);
    std::vector<std::int64_t> positions;
    for (const TokenRange& range : ranges) {
      for (std::int64_t p = range.begin; p < range.end; ++p) positions.push_back(p);
    }
    mask_document_ends(positions, shard.document_starts, seq_len_,
                       document_starts_at(document_starts_, start + seq_len_), shard.loss_mask);
  }
  return shard;
}

}  // namespace ringattn::train
