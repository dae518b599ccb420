// Packed documents: a training sequence is a window of the token stream, and the documents of the
// dataset (train/token_dataset.hpp, `document_starts`) that fall inside it are kept apart:
//
//   attention  a token sees only the tokens of its own document (ringattn::Mask::documents),
//              given the starts inside the sequence as global positions (0 = its first token);
//   RoPE       a token's rotary position is its position minus its document's start
//              (model.rope_document_positions), so every document starts at position 0;
//   loss       the target of a document's last token is the next document's first token: it is
//              left out of the loss and of the token count of the mean.
//
// The document of position p is the number of starts <= p (the rule of ringattn/attention.hpp):
// positions before the first start are document 0, and a start >= seq_len changes nothing in the
// sequence, which is how the lists of a batch's rows are padded to one length.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ringattn::train {

// The document starts inside the window of `seq_len` tokens that begins at token `window_begin`
// of the stream, as positions of the sequence: the starts s of `stream_starts` (sorted) with
// window_begin < s < window_begin + seq_len, minus window_begin. Position 0 is left out: a
// sequence's first token starts its first document whatever the stream says.
std::vector<std::int64_t> window_document_starts(std::span<const std::int64_t> stream_starts,
                                                 std::int64_t window_begin, std::int64_t seq_len);

// Whether a document starts at stream token window_begin + seq_len, the target of the window's
// last token.
bool document_starts_at(std::span<const std::int64_t> stream_starts, std::int64_t token);

// Zeroes the loss weight of every target that begins a new document: loss_mask[i] belongs to the
// token at sequence position positions[i], whose target is the token at positions[i] + 1; it is
// zeroed where positions[i] + 1 is one of `starts` (positions of the sequence, sorted) or where
// positions[i] + 1 == seq_len and `next_starts` (a document starts right after the window).
void mask_document_ends(std::span<const std::int64_t> positions,
                        std::span<const std::int64_t> starts, std::int64_t seq_len,
                        bool next_starts, std::span<float> loss_mask);

// The rotary position of each token: positions[i] minus the start of its document (the largest
// start <= positions[i], or 0 when there is none).
std::vector<std::int64_t> document_positions(std::span<const std::int64_t> positions,
                                             std::span<const std::int64_t> starts);

// The same documents for an attention that sees the tokens at `positions` (increasing) as a
// sequence of their own, indexed 0 .. positions.size() - 1 (the parallel.local_attention
// control): the local indices i > 0 where the document changes from token i - 1 to token i.
std::vector<std::int64_t> local_document_starts(std::span<const std::int64_t> positions,
                                                std::span<const std::int64_t> starts);

// The lists of a batch's rows as one [rows, count] array (count = the longest list), shorter lists
// padded with `pad` (>= the sequence length: an empty document).
struct DocumentBatch {
  std::vector<std::int64_t> starts;  // [rows, count], row-major
  std::int64_t count = 0;
};
DocumentBatch pad_document_lists(std::span<const std::vector<std::int64_t>> rows, std::int64_t pad);

}  // namespace ringattn::train
