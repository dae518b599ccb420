// Packed documents on the data side (train/documents.hpp, train/token_dataset.hpp): the starts a
// window of the stream carries, the loss mask at document ends, document-relative positions, the
// `document_starts` dataset as TokenDatasetWriter and ringattn-data write it (from several files
// and from an end-of-document token) against offsets computed here, the checks of a bad one, and
// the identity the ranks compare covering it. Every expected value is computed independently in
// the test, by a scan of the tokens or by hand.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "tests/train/temp_dir.hpp"
#include "train/documents.hpp"
#include "train/shard_ranges.hpp"
#include "train/token_dataset.hpp"
#include "train/token_dataset_writer.hpp"

namespace ringattn::train {
namespace {

namespace fs = std::filesystem;
using test::throws_error_with;

// The document of position p by the rule of ringattn/attention.hpp: the number of starts <= p.
std::int64_t document_of(const std::vector<std::int64_t>& starts, std::int64_t p) {
  std::int64_t count = 0;
  for (const std::int64_t s : starts) count += s <= p ? 1 : 0;
  return count;
}

TEST(Documents, WindowStartsArePositionsInsideTheSequence) {
  const std::vector<std::int64_t> stream = {0, 7, 10, 30, 31, 64};
  // Window [10, 42): 10 is its first token (left out), 30 and 31 inside, 64 beyond.
  EXPECT_EQ(window_document_starts(stream, 10, 32), (std::vector<std::int64_t>{20, 21}));
  EXPECT_EQ(window_document_starts(stream, 0, 7), std::vector<std::int64_t>{});
  EXPECT_EQ(window_document_starts(stream, 0, 8), (std::vector<std::int64_t>{7}));
  EXPECT_TRUE(document_starts_at(stream, 64));
  EXPECT_FALSE(document_starts_at(stream, 63));
}

// A hand-built sequence of 8 tokens with a document starting at position 3 and another right
// after the window: the targets of positions 2 (the token at 3) and 7 (the token at 8) are out.
TEST(Documents, LossMaskDropsTheTargetThatBeginsTheNextDocument) {
  const std::vector<std::int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> mask(8, 1.0f);
  mask_document_ends(positions, std::vector<std::int64_t>{3}, 8, true, mask);
  EXPECT_EQ(mask, (std::vector<float>{1, 1, 0, 1, 1, 1, 1, 0}));
  std::vector<float> open(8, 1.0f);
  mask_document_ends(positions, std::vector<std::int64_t>{3}, 8, false, open);
  EXPECT_EQ(open, (std::vector<float>{1, 1, 0, 1, 1, 1, 1, 1}));
  // A zigzag shard (positions 2, 3 and 6, 7 of 8): the same rule by position.
  std::vector<float> shard(4, 1.0f);
  mask_document_ends(std::vector<std::int64_t>{2, 3, 6, 7}, std::vector<std::int64_t>{3}, 8, true,
                     shard);
  EXPECT_EQ(shard, (std::vector<float>{0, 1, 1, 0}));
}

TEST(Documents, RopePositionsRestartAndLocalStartsFollowTheDocuments) {
  const std::vector<std::int64_t> starts = {3, 9};
  const std::vector<std::int64_t> positions = {0, 1, 2, 3, 4, 8, 9, 10, 11};
  EXPECT_EQ(document_positions(positions, starts),
            (std::vector<std::int64_t>{0, 1, 2, 0, 1, 5, 0, 1, 2}));
  // Zigzag shard of rank 0 of 2 over 16 tokens: chunks 0 and 3 (positions 0..3, 12..15).
  const std::vector<std::int64_t> shard = {0, 1, 2, 3, 12, 13, 14, 15};
  EXPECT_EQ(local_document_starts(shard, starts), (std::vector<std::int64_t>{3, 4}));
  for (std::size_t i = 1; i < shard.size(); ++i) {
    const auto local = local_document_starts(shard, starts);
    const bool listed = std::find(local.begin(), local.end(), std::int64_t(i)) != local.end();
    EXPECT_EQ(listed, document_of(starts, shard[i]) != document_of(starts, shard[i - 1])) << i;
  }
  const std::vector<std::vector<std::int64_t>> rows = {{5}, {}, {2, 6, 7}};
  const DocumentBatch batch = pad_document_lists(rows, 16);
  EXPECT_EQ(batch.count, 3);
  EXPECT_EQ(batch.starts, (std::vector<std::int64_t>{5, 16, 16, 16, 16, 16, 2, 6, 7}));
}

// read_shard with documents: the shard's starts and its loss mask, for every rank of a zigzag
// ring, against a scan of the stream in the test.
TEST(Documents, ReadShardCarriesStartsAndMasksDocumentEnds) {
  SCOPED_TRACE(test::seed_trace());
  test::TempDir dir;
  std::mt19937_64 rng = test::make_rng(1);
  std::vector<std::int32_t> tokens(200);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 50);
  std::vector<std::int64_t> starts = {0};
  while (starts.back() < 190) starts.push_back(starts.back() + 1 + static_cast<std::int64_t>(rng() % 9));
  starts.pop_back();
  starts.push_back(32);  // right after the window of sequence 0: its last target is masked
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  write_token_dataset(dir / "docs.h5", tokens, 50, "test", starts);
  const std::int64_t seq_len = 32;
  const TokenDataset data(dir / "docs.h5", 64, seq_len);
  ASSERT_TRUE(data.has_documents());
  EXPECT_EQ(data.document_starts(), starts);
  for (std::int64_t sequence : {std::int64_t{0}, std::int64_t{3}, data.num_sequences() - 1}) {
    const std::int64_t begin = sequence * seq_len;
    std::vector<std::int64_t> expected_starts;
    for (const std::int64_t s : starts) {
      if (s > begin && s < begin + seq_len) expected_starts.push_back(s - begin);
    }
    for (int rank = 0; rank < 2; ++rank) {
      const auto ranges = shard_ranges(seq_len, 2, rank, ShardLayout::zigzag);
      const TokenShard shard = data.read_shard(sequence, ranges, true);
      EXPECT_EQ(shard.document_starts, expected_starts) << "sequence " << sequence;
      std::size_t i = 0, excluded = 0, expected_excluded = 0;
      for (const TokenRange& r : ranges) {
        for (std::int64_t p = r.begin; p < r.end; ++p, ++i) {
          const bool crosses = document_of(starts, begin + p + 1) != document_of(starts, begin + p);
          EXPECT_EQ(shard.loss_mask[i], crosses ? 0.0f : 1.0f)
              << "sequence " << sequence << " position " << p;
          excluded += shard.loss_mask[i] == 0.0f ? 1 : 0;
          expected_excluded += crosses ? 1 : 0;
        }
      }
      EXPECT_EQ(excluded, expected_excluded);
      // Without documents: one document, every target counts.
      const TokenShard plain = data.read_shard(sequence, ranges, false);
      EXPECT_TRUE(plain.document_starts.empty());
      for (const float w : plain.loss_mask) EXPECT_EQ(w, 1.0f);
    }
  }
  // Sequence 0 ends right before the document at 32: its last target is out.
  const TokenShard first = data.read_shard(0, std::vector<TokenRange>{{0, 32}}, true);
  EXPECT_EQ(first.loss_mask.back(), 0.0f);
}

TEST(Documents, WriterEndOfDocumentTokenAndOldFiles) {
  test::TempDir dir;
  std::vector<std::int32_t> tokens = {4, 9, 0, 5, 0, 0, 7, 8, 0};
  {
    TokenDatasetWriter writer(dir / "eod.h5", static_cast<std::int64_t>(tokens.size()), 16, "t");
    writer.end_documents_at(0);
    writer.start_document();
    writer.append(std::span(tokens).subspan(0, 4));
    writer.append(std::span(tokens).subspan(4));
    writer.finish();
  }
  const TokenDataset eod(dir / "eod.h5", 16, 4);
  // Each 0 ends a document; the one at the end begins nothing.
  EXPECT_EQ(eod.document_starts(), (std::vector<std::int64_t>{0, 3, 5, 6}));

  write_token_dataset(dir / "old.h5", tokens, 16, "t");
  const TokenDataset old(dir / "old.h5", 16, 4);
  EXPECT_FALSE(old.has_documents());
  EXPECT_TRUE(old.document_starts().empty());
  // The identity covers the starts: the same tokens with other starts differ.
  write_token_dataset(dir / "other.h5", tokens, 16, "t", std::vector<std::int64_t>{0, 3, 6});
  const TokenDataset other(dir / "other.h5", 16, 4);
  const std::string a = eod.identity(), b = other.identity();
  EXPECT_NE(a, b);
  EXPECT_NE(a.find("4 document starts"), std::string::npos) << a;
  EXPECT_EQ(old.identity().find("document"), std::string::npos) << old.identity();
}

// A document_starts dataset written by hand (as another tool might) that is not increasing
// offsets of tokens is refused naming the file, the element and its value.
void write_raw_starts(const fs::path& path, const std::vector<std::int64_t>& starts,
                      hid_t type = H5T_STD_I64LE) {
  const std::vector<std::int32_t> tokens(40, 1);
  write_token_dataset(path, tokens, 8, "t");
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  const hsize_t size = starts.size();
  const hid_t space = H5Screate_simple(1, &size, nullptr);
  const hid_t set = H5Dcreate2(file, "document_starts", type, space, H5P_DEFAULT, H5P_DEFAULT,
                               H5P_DEFAULT);
  if (type == H5T_STD_I64LE) {
    H5Dwrite(set, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, starts.data());
  }
  H5Dclose(set);
  H5Sclose(space);
  H5Fclose(file);
}

TEST(Documents, BadDocumentStartsAreRefused) {
  test::TempDir dir;
  write_raw_starts(dir / "unsorted.h5", {0, 12, 7});
  EXPECT_TRUE(throws_error_with([&] { TokenDataset(dir / "unsorted.h5", 8, 4); },
                                {"unsorted.h5", "document_starts[2] is 7 after 12",
                                 "expected increasing offsets"},
                                ErrorKind::io));
  write_raw_starts(dir / "past.h5", {0, 40});
  EXPECT_TRUE(throws_error_with([&] { TokenDataset(dir / "past.h5", 8, 4); },
                                {"past.h5", "document_starts[1] is 40",
                                 "expected a token offset in [0, 40)"},
                                ErrorKind::io));
  write_raw_starts(dir / "float.h5", {0, 1}, H5T_IEEE_F64LE);
  EXPECT_TRUE(throws_error_with([&] { TokenDataset(dir / "float.h5", 8, 4); },
                                {"float.h5", "'document_starts' has type float64",
                                 "expected integers"},
                                ErrorKind::io));
}

// ---- ringattn-data, run as a program (found as tests/tools/cpu_data.cpp finds it) ---------------

fs::path tool_path() {
  if (const char* path = std::getenv("RINGATTN_DATA_TOOL"); path != nullptr && *path != '\0') {
    return path;
  }
  return fs::canonical("/proc/self/exe").parent_path().parent_path() / "ringattn-data";
}

int run_tool(const test::TempDir& dir, const std::string& arguments, std::string* err) {
  const std::string command = "'" + tool_path().string() + "' " + arguments + " >'" +
                              (dir / "stdout").string() + "' 2>'" + (dir / "stderr").string() +
                              "'";
  const int status = std::system(command.c_str());
  std::ifstream in(dir / "stderr");
  *err = std::string(std::istreambuf_iterator<char>(in), {});
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The starts of one split computed from the files' parts: each part begins a document, and with
// an end token every token after one (inside the split) does too.
std::vector<std::int64_t> expected_starts(const std::vector<std::string>& parts, int eod) {
  std::vector<std::int64_t> starts;
  std::int64_t offset = 0;
  const auto add = [&](std::int64_t s) {
    if (starts.empty() || starts.back() < s) starts.push_back(s);
  };
  for (const std::string& part : parts) {
    add(offset);
    for (std::size_t i = 0; i < part.size(); ++i) {
      if (eod >= 0 && static_cast<unsigned char>(part[i]) == eod) add(offset + i + 1);
    }
    offset += static_cast<std::int64_t>(part.size());
  }
  while (!starts.empty() && starts.back() >= offset) starts.pop_back();
  return starts;
}

TEST(Documents, RingattnDataWritesTheStartsOfEveryFileAndEndToken) {
  SCOPED_TRACE(test::seed_trace());
  test::TempDir dir;
  std::mt19937_64 rng = test::make_rng(2);
  std::vector<std::string> contents;
  std::string files;
  for (int f = 0; f < 3; ++f) {
    std::string text(100 + rng() % 200, '\0');
    for (auto& c : text) c = static_cast<char>('a' + rng() % 20);
    // Newlines at random places, one at the very end of file 1 and one at the start of file 2.
    for (int k = 0; k < 5; ++k) text[rng() % text.size()] = '\n';
    if (f == 1) text.back() = '\n';
    if (f == 2) text.front() = '\n';
    contents.push_back(text);
    const fs::path path = dir / ("in" + std::to_string(f) + ".txt");
    std::ofstream(path, std::ios::binary) << text;
    files += " '" + path.string() + "'";
  }
  const double fraction = 0.1;
  std::string err;
  for (const int eod : {-1, int{'\n'}}) {
    const std::string out = (dir / ("out" + std::to_string(eod + 1))).string();
    const std::string eod_option = eod >= 0 ? " --eod-token " + std::to_string(eod) : "";
    ASSERT_EQ(run_tool(dir, "--out '" + out + "' --val-fraction 0.1" + eod_option + files, &err),
              0)
        << err;
    std::vector<std::string> train_parts, val_parts;
    for (const std::string& text : contents) {
      const auto val = static_cast<std::size_t>(std::floor(text.size() * fraction));
      train_parts.push_back(text.substr(0, text.size() - val));
      val_parts.push_back(text.substr(text.size() - val));
    }
    const TokenDataset train(out + ".train.h5", 256, 8), val(out + ".val.h5", 256, 8);
    ASSERT_TRUE(train.has_documents());
    EXPECT_EQ(train.document_starts(), expected_starts(train_parts, eod)) << "eod " << eod;
    EXPECT_EQ(val.document_starts(), expected_starts(val_parts, eod)) << "eod " << eod;
    if (eod < 0) {
      EXPECT_EQ(train.document_starts().size(), 3u);
    } else {
      EXPECT_GT(train.document_starts().size(), 3u);
    }
  }
  EXPECT_NE(run_tool(dir, "--out '" + (dir / "bad").string() + "' --eod-token 256" + files, &err),
            0);
  EXPECT_NE(err.find("--eod-token"), std::string::npos) << err;
  EXPECT_NE(err.find("256"), std::string::npos) << err;
}

}  // namespace
}  // namespace ringattn::train
