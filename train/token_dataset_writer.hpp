// Writes a token dataset in the format train/token_dataset.hpp reads, streaming: the size is
// fixed up front (a contiguous dataset, the fastest to read by hyperslab), tokens arrive in
// pieces. The file is written as `<path>.tmp` and appears under its name only when finish()
// succeeds, so an interrupted conversion never leaves a dataset that looks complete.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "train/hdf5_objects.hpp"

namespace ringattn::train {

class TokenDatasetWriter {
 public:
  // Tokens are stored as uint16 when vocab_size <= 65536, else uint32.
  TokenDatasetWriter(const std::filesystem::path& path, std::int64_t num_tokens, int vocab_size,
                     const std::string& tokenizer);
  ~TokenDatasetWriter();  // without finish(): closes and removes the temporary file
  TokenDatasetWriter(const TokenDatasetWriter&) = delete;
  TokenDatasetWriter& operator=(const TokenDatasetWriter&) = delete;

  // The next tokens; each must be in [0, vocab_size). Throws past num_tokens.
  void append(std::span<const std::int32_t> tokens);
  std::int64_t written() const { return written_; }
  // Checks that num_tokens were written, closes the file and publishes it under its name.
  void finish();

 private:
  std::filesystem::path path_, temporary_;
  std::string name_;
  Hdf5Id file_;
  Hdf5Id tokens_;
  std::int64_t num_tokens_;
  int vocab_size_;
  std::int64_t written_ = 0;
  bool finished_ = false;
};

// The whole dataset at once (tests, small tools).
void write_token_dataset(const std::filesystem::path& path, std::span<const std::int32_t> tokens,
                         int vocab_size, const std::string& tokenizer);

}  // namespace ringattn::train
