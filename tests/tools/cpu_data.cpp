// ringattn-data, run as a program: text files in, two token datasets out whose tokens are the
// files' bytes (the head of each file for training, its tail for validation), read back through
// TokenDataset; a missing input fails naming it.
//
// The program is found beside the test binaries' directory (<build>/ringattn-data next to
// <build>/tests/), or at $RINGATTN_DATA_TOOL.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/temp_dir.hpp"
#include "train/token_dataset.hpp"

namespace ringattn::train {
namespace {

namespace fs = std::filesystem;

fs::path tool_path() {
  if (const char* path = std::getenv("RINGATTN_DATA_TOOL"); path != nullptr && *path != '\0') {
    return path;
  }
  return fs::canonical("/proc/self/exe").parent_path().parent_path() / "ringattn-data";
}

struct ToolRun {
  int status;
  std::string out, err;
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs the tool with `arguments` (already quoted), capturing its output in files of `dir`.
ToolRun run_tool(const test::TempDir& dir, const std::string& arguments) {
  std::ostringstream command;
  command << '\'' << tool_path().string() << "' " << arguments << " >'" << (dir / "stdout").string()
          << "' 2>'" << (dir / "stderr").string() << '\'';
  const int status = std::system(command.str().c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir / "stdout"),
          slurp(dir / "stderr")};
}

std::string random_bytes(std::size_t count, std::mt19937_64& rng) {
  std::string bytes(count, '\0');
  for (auto& b : bytes) b = static_cast<char>(rng() & 0xff);  // every byte value, 0 and 255 too
  return bytes;
}

std::vector<std::int32_t> read_all(const TokenDataset& dataset) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(dataset.num_tokens()));
  dataset.read_tokens(0, tokens);
  return tokens;
}

std::vector<std::int32_t> as_tokens(const std::string& bytes) {
  std::vector<std::int32_t> tokens;
  for (const char b : bytes) tokens.push_back(static_cast<unsigned char>(b));
  return tokens;
}

class DataTool : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(tool_path())) << tool_path() << " is not built (build all targets, or "
                                         << "set RINGATTN_DATA_TOOL)";
  }
  test::TempDir dir;
};

TEST_F(DataTool, TokensAreTheBytesSplitPerFile) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng();
  const std::string a = random_bytes(1000, rng), b = random_bytes(3001, rng);
  std::ofstream(dir / "a.txt", std::ios::binary) << a;
  std::ofstream(dir / "b.txt", std::ios::binary) << b;

  const ToolRun run =
      run_tool(dir, "--out '" + (dir / "out/text.h5").string() + "' --val-fraction 0.1 '" +
                        (dir / "a.txt").string() + "' '" + (dir / "b.txt").string() + "'");
  ASSERT_EQ(run.status, 0) << run.err;
  // floor(1000 * 0.1) = 100 and floor(3001 * 0.1) = 300 bytes of validation.
  const std::string train_bytes = a.substr(0, 900) + b.substr(0, 2701);
  const std::string val_bytes = a.substr(900) + b.substr(2701);
  EXPECT_NE(run.out.find("3601 tokens"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("400 tokens"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("data.train_path=" + (dir / "out/text.train.h5").string()),
            std::string::npos)
      << run.out;

  const TokenDataset train(dir / "out/text.train.h5", 256, 16);
  EXPECT_EQ(train.vocab_size(), 256);
  EXPECT_EQ(train.tokenizer(), "byte");
  EXPECT_EQ(train.token_type(), "uint16");
  EXPECT_EQ(read_all(train), as_tokens(train_bytes));
  const TokenDataset val(dir / "out/text.val.h5", 256, 16);
  EXPECT_EQ(read_all(val), as_tokens(val_bytes));
}

TEST_F(DataTool, NoValidationFileAtFractionZero) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const std::string text = random_bytes(777, rng);
  std::ofstream(dir / "t.txt", std::ios::binary) << text;
  const ToolRun run = run_tool(dir, "--out '" + (dir / "d").string() + "' --val-fraction 0 '" +
                                        (dir / "t.txt").string() + "'");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(read_all(TokenDataset(dir / "d.train.h5", 256, 16)), as_tokens(text));
  EXPECT_FALSE(fs::exists(dir / "d.val.h5"));
}

TEST_F(DataTool, MissingInputFailsNamingIt) {
  std::ofstream(dir / "t.txt") << "some text\n";
  const ToolRun run =
      run_tool(dir, "--out '" + (dir / "d.h5").string() + "' '" + (dir / "t.txt").string() + "' '" +
                        (dir / "gone.txt").string() + "'");
  EXPECT_NE(run.status, 0);
  EXPECT_NE(run.err.find("input '" + (dir / "gone.txt").string() + "' does not exist"),
            std::string::npos)
      << run.err;
  EXPECT_FALSE(fs::exists(dir / "d.train.h5"));
}

TEST_F(DataTool, EmptyValidationSplitFails) {
  std::ofstream(dir / "t.txt") << "tiny";
  const ToolRun run =
      run_tool(dir, "--out '" + (dir / "d.h5").string() + "' '" + (dir / "t.txt").string() + "'");
  EXPECT_NE(run.status, 0);
  EXPECT_NE(run.err.find("the validation split is empty"), std::string::npos) << run.err;
}

}  // namespace
}  // namespace ringattn::train
