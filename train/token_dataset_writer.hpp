// Writes a token dataset in the format train/token_dataset.hpp reads, streaming: the size is
// fixed up front (a contiguous dataset, the fastest to read by hyperslab), tokens arrive in
// pieces. The file is written as `<path>.tmp` and appears under its name only when finish()
// succeeds, so an interrupted conversion never leaves a dataset that looks complete.
// Document boundaries (start_document, end_documents_at) are kept in memory, one int64 a
// document, and written by finish() as `document_starts`; a writer given none writes no
// `document_starts` (the whole stream is then one document, as in files from before it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

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
  // A document starts at the next token appended (twice at the same token: once).
  void start_document();
  // From now on, a document starts after every `token` appended (the end-of-document token,
  // which stays the last token of its document).
  void end_documents_at(std::int32_t token);
  const std::vector<std::int64_t>& document_starts() const { return starts_; }
  std::int64_t written() const { return written_; }
  // Checks that num_tokens were written, closes the file and publishes it under its name.
  void finish();

 private:
  void add_start(std::int64_t token);

  std::filesystem::path path_, temporary_;
  std::string name_;
  Hdf5Id file_;
  Hdf5Id tokens_;
  std::int64_t num_tokens_;
  int vocab_size_;
  std::int64_t written_ = 0;
  bool finished_ = false;
  std::vector<std::int64_t> starts_;  // increasing
  bool documents_ = false;            // start_document or end_documents_at was called
  std::int32_t end_token_ = -1;       // -1: none
};

// The whole dataset at once (tests, small tools); with `document_starts` (sorted token offsets,
// the first usually 0) a `document_starts` dataset too.
void write_token_dataset(const std::filesystem::path& path, std::span<const std::int32_t> tokens,
                         int vocab_size, const std::string& tokenizer,
                         std::span<const std::int64_t> document_starts = {});

}  // namespace ringattn::train
