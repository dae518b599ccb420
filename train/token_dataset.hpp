// The HDF5 token dataset the trainer reads: one file holding
//
//   /tokens                      1-D dataset, uint16 or uint32, the token ids of a corpus
//   /tokens attribute vocab_size  integer: every token is < vocab_size
//   /tokens attribute tokenizer   string: how text became tokens ("byte": one token per byte)
//   /document_starts             optional 1-D integer dataset: the token offsets where documents
//                                begin, increasing, each in [0, number of tokens); without it the
//                                whole stream is one document (files from before it load as such)
//
// (tools/data.cpp, `ringattn-data`, writes it from text files; train/token_dataset_writer.hpp.)
// Sequences are windows of seq_len + 1 tokens (train/sequence_sampler.hpp says which one is read
// when), and a context-parallel rank reads only its shard of each, by hyperslab: for every range
// of its layout (train/shard_ranges.hpp) the range plus the one token after it.
//
// Every problem with the file is a ringattn::Error naming the file and what is wrong with it,
// never a crash: missing file, not HDF5, corrupt, no `tokens`, wrong type or rank, a missing or
// mistyped attribute, a `document_starts` that is not increasing offsets of tokens (ErrorKind::io); a vocabulary larger than the model's, or fewer tokens than
// one sequence (ErrorKind::invalid_argument); a token >= vocab_size found by a read (io).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "train/hdf5_objects.hpp"
#include "train/shard_ranges.hpp"

namespace ringattn::train {

class TokenDataset {
 public:
  // Opens `path` for sequences of seq_len + 1 tokens, for a model whose vocabulary has
  // model_vocab_size tokens (the dataset's vocab_size may be smaller: a model may pad its
  // vocabulary, never cut it).
  TokenDataset(const std::filesystem::path& path, int model_vocab_size, std::int64_t seq_len);

  const std::filesystem::path& path() const { return path_; }
  std::int64_t num_tokens() const { return num_tokens_; }
  int vocab_size() const { return vocab_size_; }
  const std::string& tokenizer() const { return tokenizer_; }
  const std::string& token_type() const { return token_type_; }  // "uint16" or "uint32"
  std::int64_t seq_len() const { return seq_len_; }
  // Windows of seq_len + 1 tokens starting at multiples of seq_len: (num_tokens - 1) / seq_len.
  std::int64_t num_sequences() const { return (num_tokens_ - 1) / seq_len_; }
  // Whether the file has `document_starts`, and its offsets (empty without it).
  bool has_documents() const { return has_documents_; }
  const std::vector<std::int64_t>& document_starts() const { return document_starts_; }

  // What ranks compare to know they read the same corpus, wherever each one's copy lies: "N tokens,
  // vocab V, tokenizer T, type, B bytes, digest H", H the digest (train/digest.hpp) of every token,
  // read in chunks of the file's type, followed by the document starts where the file has them
  // ("..., D document starts, digest H"). Each token is checked against vocab_size on the way, so a
  // token outside the vocabulary anywhere in the file is found here (an Error as read_tokens
  // gives) rather than in the step that reads it. Costs one read of the file on every rank: 0.05 s
  // for 100M uint16 tokens (200 MB) in the page cache, 0.1 s from a local disk (0.25 and 0.6 s a
  // GB; the digest alone runs at 7-10 GB/s), a shared filesystem's speed otherwise.
  std::string identity() const;

  // Tokens [begin, begin + out.size()) of the file.
  void read_tokens(std::int64_t begin, std::span<std::int32_t> out) const;

  // This rank's shard of sequence `sequence` (0 <= sequence < num_sequences()): for each range
  // [b, e) of `ranges` (global positions within the sequence), inputs = tokens b..e-1 and
  // targets = tokens b+1..e of the sequence; the loss mask is all ones. With `documents`
  // (train/documents.hpp): the shard's document_starts are the sequence's, and the loss mask is 0
  // at every target that begins a document.
  TokenShard read_shard(std::int64_t sequence, std::span<const TokenRange> ranges,
                        bool documents = false) const;
  // The document starts of sequence `sequence` (0 < s < seq_len, increasing), as read_shard gives
  // them with `documents`: what a layout that follows the documents needs before the tokens.
  std::vector<std::int64_t> sequence_document_starts(std::int64_t sequence) const;

 private:
  void read_document_starts();

  std::filesystem::path path_;
  std::string name_;  // path_ as text, for messages
  Hdf5Id file_;
  Hdf5Id tokens_;
  std::int64_t num_tokens_ = 0;
  int vocab_size_ = 0;
  std::string tokenizer_;
  std::string token_type_;
  std::int64_t seq_len_ = 0;
  bool has_documents_ = false;
  std::vector<std::int64_t> document_starts_;
};

}  // namespace ringattn::train
