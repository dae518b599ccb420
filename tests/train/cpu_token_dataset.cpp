// The HDF5 token dataset: written and read back exactly (uint16 and uint32), shard reads equal
// the slices of the sequence they stand for, the identity ranks compare covers every token, and
// every malformed file gives an error naming the file and the problem. Malformed files are made
// with the raw HDF5 API, as another tool would.
#include "train/token_dataset.hpp"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "tests/train/temp_dir.hpp"
#include "train/token_dataset_writer.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

std::vector<std::int32_t> random_tokens(std::size_t count, int vocab, std::mt19937_64& rng) {
  std::vector<std::int32_t> tokens(count);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return tokens;
}

// A file as some other tool might write it: a dataset `name` of `type` and `dims`, filled with
// 0, 1, 2, ..., and the attributes asked for (an attribute is left out when its pointer is null).
struct RawFile {
  std::string dataset = "tokens";
  hid_t type = H5T_STD_U16LE;
  std::vector<hsize_t> dims = {1000};
  const std::int64_t* vocab_size = nullptr;
  const double* vocab_size_float = nullptr;
  const char* tokenizer = nullptr;
  bool variable_length_tokenizer = false;
  const std::int64_t* tokenizer_int = nullptr;
  bool dataset_is_group = false;
};

void write_raw(const std::filesystem::path& path, const RawFile& raw) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  if (raw.dataset_is_group) {
    H5Gclose(H5Gcreate2(file, raw.dataset.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Fclose(file);
    return;
  }
  const hid_t space = H5Screate_simple(static_cast<int>(raw.dims.size()), raw.dims.data(), nullptr);
  const hid_t dataset =
      H5Dcreate2(file, raw.dataset.c_str(), raw.type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  hsize_t count = 1;
  for (const hsize_t d : raw.dims) count *= d;
  std::vector<double> values(count);
  for (hsize_t i = 0; i < count; ++i) values[i] = static_cast<double>(i % 60000);
  H5Dwrite(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
  const hid_t scalar = H5Screate(H5S_SCALAR);
  auto attribute = [&](const char* name, hid_t file_type, hid_t memory_type, const void* value) {
    const hid_t a = H5Acreate2(dataset, name, file_type, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, memory_type, value);
    H5Aclose(a);
  };
  if (raw.vocab_size) attribute("vocab_size", H5T_STD_I64LE, H5T_NATIVE_INT64, raw.vocab_size);
  if (raw.vocab_size_float) {
    attribute("vocab_size", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, raw.vocab_size_float);
  }
  if (raw.tokenizer_int) attribute("tokenizer", H5T_STD_I64LE, H5T_NATIVE_INT64, raw.tokenizer_int);
  if (raw.tokenizer) {
    const hid_t string_type = H5Tcopy(H5T_C_S1);
    if (raw.variable_length_tokenizer) {
      H5Tset_size(string_type, H5T_VARIABLE);
      attribute("tokenizer", string_type, string_type, &raw.tokenizer);
    } else {
      H5Tset_size(string_type, std::string(raw.tokenizer).size());
      H5Tset_strpad(string_type, H5T_STR_NULLPAD);
      attribute("tokenizer", string_type, string_type, raw.tokenizer);
    }
    H5Tclose(string_type);
  }
  H5Sclose(scalar);
  H5Dclose(dataset);
  H5Sclose(space);
  H5Fclose(file);
}

// Token `position` of the file's 'tokens' set to `value`, in place (as a bad copy or another
// writer might leave it; the writer itself refuses tokens outside the vocabulary).
void overwrite_token(const std::filesystem::path& path, hsize_t position, std::uint32_t value) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  const hid_t dataset = H5Dopen2(file, "tokens", H5P_DEFAULT);
  const hid_t file_space = H5Dget_space(dataset);
  const hsize_t one = 1;
  H5Sselect_hyperslab(file_space, H5S_SELECT_SET, &position, nullptr, &one, nullptr);
  const hid_t memory_space = H5Screate_simple(1, &one, nullptr);
  EXPECT_GE(H5Dwrite(dataset, H5T_NATIVE_UINT32, memory_space, file_space, H5P_DEFAULT, &value), 0);
  H5Sclose(memory_space);
  H5Sclose(file_space);
  H5Dclose(dataset);
  H5Fclose(file);
}

// The identity reads the file in chunks of 2^22 tokens: the test files cross one.
constexpr std::int64_t kIdentityChunk = std::int64_t{1} << 22;

TEST(TokenDataset, WrittenTokensReadBackExactly) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng();
  const test::TempDir dir;
  for (const int vocab : {256, 65536, 100000}) {
    SCOPED_TRACE(vocab);
    const auto path = dir / ("v" + std::to_string(vocab) + ".h5");
    const std::vector<std::int32_t> tokens = random_tokens(5003, vocab, rng);
    write_token_dataset(path, tokens, vocab, "byte");
    EXPECT_FALSE(std::filesystem::exists(path.string() + ".tmp"));
    const TokenDataset dataset(path, vocab, 100);
    EXPECT_EQ(dataset.num_tokens(), 5003);
    EXPECT_EQ(dataset.vocab_size(), vocab);
    EXPECT_EQ(dataset.tokenizer(), "byte");
    EXPECT_EQ(dataset.token_type(), vocab <= 65536 ? "uint16" : "uint32");
    EXPECT_EQ(dataset.num_sequences(), 50);  // (5003 - 1) / 100
    std::vector<std::int32_t> back(tokens.size(), -1);
    dataset.read_tokens(0, back);
    EXPECT_EQ(back, tokens);
    std::vector<std::int32_t> middle(17, -1);
    dataset.read_tokens(4000, middle);
    EXPECT_EQ(middle, std::vector<std::int32_t>(tokens.begin() + 4000, tokens.begin() + 4017));
  }
}

// A rank's shard of sequence s holds, at each of its positions p, input = token s * S + p and
// target = token s * S + p + 1, for both layouts and several cp.
TEST(TokenDataset, ShardReadsAreTheSlicesOfTheSequence) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const test::TempDir dir;
  const std::int64_t seq_len = 48;
  const std::vector<std::int32_t> tokens = random_tokens(seq_len * 7 + 1, 300, rng);
  write_token_dataset(dir / "d.h5", tokens, 300, "test");
  const TokenDataset dataset(dir / "d.h5", 512, seq_len);
  ASSERT_EQ(dataset.num_sequences(), 7);
  for (const ShardLayout layout : {ShardLayout::zigzag, ShardLayout::contiguous}) {
    for (const int cp : {1, 2, 3, 4}) {
      for (int rank = 0; rank < cp; ++rank) {
        for (const std::int64_t s : {0, 3, 6}) {
          const auto ranges = shard_ranges(seq_len, cp, rank, layout);
          const TokenShard shard = dataset.read_shard(s, ranges);
          std::vector<std::int32_t> inputs, targets;
          for (const TokenRange& r : ranges) {
            for (std::int64_t p = r.begin; p < r.end; ++p) {
              inputs.push_back(tokens[s * seq_len + p]);
              targets.push_back(tokens[s * seq_len + p + 1]);
            }
          }
          EXPECT_EQ(shard.inputs, inputs)
              << layout_name(layout) << " cp " << cp << " rank " << rank;
          EXPECT_EQ(shard.targets, targets);
          EXPECT_EQ(shard.loss_mask, std::vector<float>(inputs.size(), 1.0f));
        }
      }
    }
  }
  EXPECT_TRUE(
      throws_error_with([&] { dataset.read_shard(7, shard_ranges(48, 1, 0, ShardLayout::zigzag)); },
                        {"sequence 7 of '", "does not exist; it has 7"}));
}

TEST(TokenDataset, ReadsFilesOfOtherWriters) {
  const test::TempDir dir;
  const std::int64_t vocab = 1000;
  RawFile raw;
  raw.type = H5T_STD_U32BE;  // big-endian uint32 with a variable-length tokenizer string (h5py's)
  raw.vocab_size = &vocab;
  raw.tokenizer = "byte";
  raw.variable_length_tokenizer = true;
  write_raw(dir / "vl.h5", raw);
  const TokenDataset dataset(dir / "vl.h5", 1000, 10);
  EXPECT_EQ(dataset.tokenizer(), "byte");
  EXPECT_EQ(dataset.token_type(), "uint32");
  std::vector<std::int32_t> some(5);
  dataset.read_tokens(990, some);
  EXPECT_EQ(some, (std::vector<std::int32_t>{990, 991, 992, 993, 994}));

  raw.variable_length_tokenizer = false;  // fixed length, NUL-padded, no terminator
  write_raw(dir / "fixed.h5", raw);
  EXPECT_EQ(TokenDataset(dir / "fixed.h5", 1000, 10).tokenizer(), "byte");
}

// ---- malformed files ----------------------------------------------------------------------------

class TokenDatasetErrors : public ::testing::Test {
 protected:
  // Opening `name` must fail with every part and `kind`; the message must also name the file.
  ::testing::AssertionResult fails(const std::string& name,
                                   std::initializer_list<std::string_view> parts,
                                   ErrorKind kind = ErrorKind::io, int model_vocab = 256,
                                   std::int64_t seq_len = 16) {
    const std::string path = (dir / name).string();
    auto result = throws_error_with([&] { TokenDataset(path, model_vocab, seq_len); }, parts, kind);
    if (!result) return result;
    return throws_error_with([&] { TokenDataset(path, model_vocab, seq_len); }, {path});
  }
  RawFile good() const {
    RawFile raw;
    raw.vocab_size = &vocab;
    raw.tokenizer = "byte";
    return raw;
  }

  test::TempDir dir;
  std::int64_t vocab = 256;
};

TEST_F(TokenDatasetErrors, MissingFile) {
  EXPECT_TRUE(fails("missing.h5", {"token dataset '", "' does not exist"}));
}

TEST_F(TokenDatasetErrors, NotHdf5) {
  std::ofstream(dir / "text.h5") << "just some text, not HDF5\n";
  EXPECT_TRUE(fails("text.h5", {"is not an HDF5 file"}));
  EXPECT_TRUE(fails("", {"is a directory"}));
}

TEST_F(TokenDatasetErrors, TruncatedFile) {
  std::mt19937_64 rng = test::make_rng(2);
  write_token_dataset(dir / "t.h5", random_tokens(4000, 256, rng), 256, "byte");
  const auto size = std::filesystem::file_size(dir / "t.h5");
  std::filesystem::resize_file(dir / "t.h5", size / 2);
  EXPECT_TRUE(fails("t.h5", {"is corrupt or truncated"}));
}

TEST_F(TokenDatasetErrors, NoTokensDataset) {
  RawFile raw = good();
  raw.dataset = "ids";
  write_raw(dir / "f.h5", raw);
  EXPECT_TRUE(fails("f.h5", {"no dataset 'tokens'"}));
}

TEST_F(TokenDatasetErrors, TokensIsAGroup) {
  RawFile raw = good();
  raw.dataset_is_group = true;
  write_raw(dir / "f.h5", raw);
  EXPECT_TRUE(fails("f.h5", {"'tokens' is not a dataset"}));
}

TEST_F(TokenDatasetErrors, WrongType) {
  RawFile raw = good();
  raw.type = H5T_STD_I32LE;
  write_raw(dir / "i32.h5", raw);
  EXPECT_TRUE(fails("i32.h5", {"'tokens' has type int32; expected uint16 or uint32"}));
  raw.type = H5T_IEEE_F32LE;
  write_raw(dir / "f32.h5", raw);
  EXPECT_TRUE(fails("f32.h5", {"'tokens' has type float32; expected uint16 or uint32"}));
  raw.type = H5T_STD_U8LE;
  write_raw(dir / "u8.h5", raw);
  EXPECT_TRUE(fails("u8.h5", {"'tokens' has type uint8"}));
}

TEST_F(TokenDatasetErrors, WrongRank) {
  RawFile raw = good();
  raw.dims = {10, 100};
  write_raw(dir / "f.h5", raw);
  EXPECT_TRUE(fails("f.h5", {"'tokens' has 2 dimensions [10, 100]; expected 1"}));
}

TEST_F(TokenDatasetErrors, MissingOrMistypedAttributes) {
  RawFile raw = good();
  raw.vocab_size = nullptr;
  write_raw(dir / "no_vocab.h5", raw);
  EXPECT_TRUE(fails("no_vocab.h5", {"no attribute 'vocab_size'"}));
  const double float_vocab = 256.0;
  raw.vocab_size_float = &float_vocab;
  write_raw(dir / "float_vocab.h5", raw);
  EXPECT_TRUE(fails("float_vocab.h5", {"attribute 'vocab_size' of 'tokens' is not an integer"}));

  raw = good();
  raw.tokenizer = nullptr;
  write_raw(dir / "no_tokenizer.h5", raw);
  EXPECT_TRUE(fails("no_tokenizer.h5", {"no attribute 'tokenizer'"}));
  const std::int64_t number = 7;
  raw.tokenizer_int = &number;
  write_raw(dir / "int_tokenizer.h5", raw);
  EXPECT_TRUE(fails("int_tokenizer.h5", {"attribute 'tokenizer' of 'tokens' is not a string"}));

  raw = good();
  const std::int64_t too_big = 70000;  // more than uint16 tokens can hold
  raw.vocab_size = &too_big;
  write_raw(dir / "big_vocab.h5", raw);
  EXPECT_TRUE(fails("big_vocab.h5",
                    {"attribute 'vocab_size' is 70000; expected 1 to 65536 for uint16"},
                    ErrorKind::io, 100000));
}

TEST_F(TokenDatasetErrors, VocabularyLargerThanTheModels) {
  std::mt19937_64 rng = test::make_rng(3);
  write_token_dataset(dir / "v.h5", random_tokens(100, 50257, rng), 50257, "gpt2");
  EXPECT_TRUE(fails("v.h5",
                    {"has vocab_size 50257 (tokenizer 'gpt2'), more than model.vocab_size 32768"},
                    ErrorKind::invalid_argument, 32768));
  EXPECT_NO_THROW(TokenDataset(dir / "v.h5", 50304, 16));  // a padded vocabulary is fine
}

TEST_F(TokenDatasetErrors, TooShortForOneSequence) {
  std::mt19937_64 rng = test::make_rng(4);
  write_token_dataset(dir / "s.h5", random_tokens(256, 256, rng), 256, "byte");
  EXPECT_TRUE(fails("s.h5", {"holds 256 tokens; one sequence of train.seq_len = 256 needs 257"},
                    ErrorKind::invalid_argument, 256, 256));
  EXPECT_NO_THROW(TokenDataset(dir / "s.h5", 256, 255));
}

TEST_F(TokenDatasetErrors, TokenOutsideTheVocabularyIsFoundByTheRead) {
  const std::int64_t small_vocab = 500;  // the raw file holds 0..999
  RawFile raw = good();
  raw.vocab_size = &small_vocab;
  write_raw(dir / "f.h5", raw);
  const TokenDataset dataset(dir / "f.h5", 500, 16);
  std::vector<std::int32_t> out(16);
  EXPECT_NO_THROW(dataset.read_tokens(400, out));
  EXPECT_TRUE(throws_error_with(
      [&] { dataset.read_tokens(490, out); },
      {"token 500 at position 500", "outside the vocabulary [0, 500)", (dir / "f.h5").string()},
      ErrorKind::io));
}

// Ranks compare identities to know their copies hold the same tokens: a copy is the same, and one
// token changed anywhere (the ends, the middle, either side of a chunk boundary) is told apart, for
// uint16 and uint32 files.
TEST(TokenDataset, IdentityCoversEveryToken) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(5);
  const test::TempDir dir;
  const std::int64_t count = kIdentityChunk + 1000;
  for (const int vocab : {256, 100000}) {
    SCOPED_TRACE(vocab);
    const std::vector<std::int32_t> tokens = random_tokens(count, vocab, rng);
    const auto original = dir / "original.h5";
    write_token_dataset(original, tokens, vocab, "byte");
    const std::string identity = TokenDataset(original, vocab, 16).identity();
    const auto copy = dir / "copy.h5";
    std::filesystem::copy_file(original, copy, std::filesystem::copy_options::overwrite_existing);
    EXPECT_EQ(TokenDataset(copy, vocab, 16).identity(), identity);
    for (const std::int64_t position :
         {std::int64_t{0}, count / 3, kIdentityChunk - 1, kIdentityChunk, count - 1}) {
      SCOPED_TRACE(position);
      std::filesystem::copy_file(original, copy, std::filesystem::copy_options::overwrite_existing);
      const auto changed = static_cast<std::uint32_t>((tokens[position] + 1) % vocab);
      overwrite_token(copy, static_cast<hsize_t>(position), changed);
      EXPECT_NE(TokenDataset(copy, vocab, 16).identity(), identity);
    }
  }
}

// The identity reads every token, so a token outside the vocabulary anywhere is found before any
// step reads it, named with its position, in the first chunk or a later one.
TEST(TokenDataset, IdentityFindsATokenOutsideTheVocabularyAnywhere) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(6);
  const test::TempDir dir;
  const auto path = dir / "bad.h5";
  for (const std::int64_t position : {std::int64_t{7}, kIdentityChunk + 50}) {
    write_token_dataset(path, random_tokens(kIdentityChunk + 100, 256, rng), 256, "byte");
    overwrite_token(path, static_cast<hsize_t>(position), 300);
    const TokenDataset dataset(path, 256, 16);
    EXPECT_TRUE(throws_error_with(
        [&] { (void)dataset.identity(); },
        {path.string(), "token 300 at position " + std::to_string(position) +
                            " is outside the vocabulary [0, 256)"},
        ErrorKind::io));
  }
}

TEST(TokenDatasetWriter, RejectsTokensOutsideTheVocabularyAndLeavesNoFile) {
  const test::TempDir dir;
  {
    TokenDatasetWriter writer(dir / "w.h5", 4, 10, "byte");
    writer.append(std::vector<std::int32_t>{1, 2});
    EXPECT_TRUE(throws_error_with(
        [&] {
          writer.append(std::vector<std::int32_t>{3, 10});
        },
        {"token 10 at position 3 is outside the vocabulary [0, 10)"}));
    EXPECT_TRUE(throws_error_with([&] { writer.finish(); }, {"finish() after 2 of 4 tokens"}));
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "w.h5"));
  EXPECT_FALSE(std::filesystem::exists(dir / "w.h5.tmp"));
}

}  // namespace
}  // namespace ringattn::train
