// TrainConfig: YAML round trip (every key, numbers bit for bit), --set overrides, and the message
// of every error: unknown keys with their suggestion, wrong types, out-of-range values and
// impossible combinations, each naming the key and the value.
#include "train/config.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_checks.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "tests/train/temp_dir.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

TEST(Config, DefaultsAreValidOnTwoRanks) {
  EXPECT_NO_THROW(validate(TrainConfig{}, 2));
  EXPECT_EQ(TrainConfig{}.model.resolved_head_dim(), 16);
}

TEST(Config, EveryKeyIsListedOnce) {
  const std::vector<std::string>& keys = config_keys();
  EXPECT_EQ(keys.size(), 56u);
  for (const char* key :
       {"model.head_dim", "model.v_head_dim", "train.lr", "train.shard_optimizer",
        "train.loss_chunk_tokens", "train.mlp_chunk_tokens", "train.offload", "parallel.layout",
        "data.retrieval.pairs", "run.resume", "train.stages", "model.attention_window",
        "model.rope_document_positions", "data.documents"}) {
    EXPECT_EQ(std::count(keys.begin(), keys.end(), key), 1) << key;
  }
}

// A config in which every key differs from its default; doubles are random bit patterns so that
// a dump that rounds (say to 6 digits) fails.
TrainConfig random_config(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto real = [&](double scale) { return scale * (0.5 + unit(rng)); };
  auto integer = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  TrainConfig c;
  c.model = {integer(300, 5000), integer(65, 999), integer(3, 9),     integer(5, 9), integer(3, 4),
             integer(17, 99),    integer(17, 99),  integer(177, 999), false,         real(1e5),
             real(1e-6),         real(1e-2),       integer(1, 9999),  false};
  c.train.seq_len = integer(257, 9999);
  c.train.batch_size = integer(9, 99);
  c.train.grad_accum = integer(2, 9);
  c.train.steps = integer(101, 9999);
  c.train.stages = {StageConfig{integer(1, 99), integer(2, 999), std::nullopt},
                    StageConfig{integer(1, 99), integer(2, 99999), integer(1, 64)}};
  c.train.lr = real(1e-4);
  c.train.min_lr = real(1e-6);
  c.train.warmup_steps = integer(11, 99);
  c.train.weight_decay = real(0.01);
  c.train.beta1 = real(0.5);
  c.train.beta2 = real(0.6);
  c.train.adam_eps = real(1e-9);
  c.train.grad_clip = real(2.0);
  c.train.seed = rng();
  c.train.recompute = true;
  c.train.recompute_attention = true;
  c.train.loss_chunk_tokens = integer(1, 99999);
  c.train.mlp_chunk_tokens = integer(0, 99999);
  c.train.offload = Offload::on;
  c.train.deterministic = true;
  c.train.profile = true;
  c.train.shard_optimizer = true;
  c.train.log_every = integer(11, 99);
  c.train.eval_every = integer(51, 999);
  c.train.eval_batches = integer(5, 99);
  c.train.checkpoint_every = integer(1, 999);
  c.train.keep_checkpoints = integer(4, 9);
  c.parallel = {integer(2, 8), integer(3, 8), ShardLayout::contiguous};
  c.data.source = DataSource::hdf5;
  c.data.train_path = "dir with space/train: \"quoted\" #not-a-comment.h5";
  c.data.val_path = "null";  // a YAML null when unquoted: must stay the string
  c.data.documents = true;
  c.data.retrieval = {integer(9, 99), integer(2, 4), integer(2, 4), integer(9, 99)};
  c.run.dir = "~";
  c.run.backend = Backend::cpu;
  c.run.resume = "latest";
  return c;
}

TEST(Config, DumpLoadRoundTripKeepsEveryValueBitwise) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const TrainConfig original = random_config(rng);
    const std::string yaml = dump_config(original);
    const TrainConfig loaded = load_config_string(yaml, "<dump>");
    EXPECT_TRUE(loaded == original) << yaml;
    EXPECT_EQ(std::bit_cast<std::uint64_t>(loaded.train.lr),
              std::bit_cast<std::uint64_t>(original.train.lr));
    EXPECT_EQ(dump_config(loaded), yaml);
  }
}

TEST(Config, DumpOmitsAnUnsetHeadDimAndKeepsEmptyStrings) {
  const TrainConfig defaults;
  const std::string yaml = dump_config(defaults);
  EXPECT_EQ(yaml.find("head_dim"), std::string::npos) << yaml;
  // Exponent forms carry a '.', so that YAML 1.1 readers (PyYAML) see floats.
  EXPECT_NE(yaml.find("min_lr: 3.0e-04"), std::string::npos) << yaml;
  const TrainConfig loaded = load_config_string(yaml, "<dump>");
  EXPECT_FALSE(loaded.model.head_dim.has_value());
  EXPECT_FALSE(loaded.model.v_head_dim.has_value());
  EXPECT_EQ(loaded.run.resume, "");
  EXPECT_TRUE(loaded == defaults) << yaml;
}

TEST(Config, FileSetsOnlyWhatItNames) {
  const test::TempDir dir;
  const auto path = dir / "c.yaml";
  std::ofstream(path) << "# a comment\ntrain:\n  lr: 1.5e-4\n  steps: 7\ndata:\n  retrieval:\n"
                         "    pairs: 5\nrun:\n  resume:\n";
  const TrainConfig c = load_config_file(path);
  TrainConfig expected;
  expected.train.lr = 1.5e-4;
  expected.train.steps = 7;
  expected.data.retrieval.pairs = 5;
  EXPECT_TRUE(c == expected) << dump_config(c);
}

// A config file that sets nothing (empty, or comments only) is refused naming the file: running
// the defaults would hide a wrong file.
TEST(Config, EmptyConfigIsRefusedNamingTheFile) {
  for (const char* text : {"", "# only a comment\n\n# and another\n", "---\n"}) {
    EXPECT_TRUE(throws_error_with([&] { load_config_string(text, "empty.yaml"); },
                                  {"load_config: empty.yaml: the config sets no key",
                                   "empty or holds only comments"}))
        << "'" << text << "'";
  }
  const test::TempDir dir;
  std::ofstream(dir / "blank.yaml") << "# nothing here\n";
  EXPECT_TRUE(throws_error_with([&] { load_config_file(dir / "blank.yaml"); },
                                {"blank.yaml: the config sets no key"}));
}

// config_items lists every key with its value, so that ranks comparing them name the keys that
// differ: one changed key changes exactly one item.
TEST(Config, ItemsNameEveryKeyAndItsValue) {
  TrainConfig a;
  const std::string items = config_items(a);
  std::vector<std::string> split;
  for (std::size_t start = 0;;) {
    const std::size_t end = items.find("; ", start);
    split.push_back(items.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 2;
  }
  ASSERT_EQ(split.size(), config_keys().size());
  for (std::size_t i = 0; i < split.size(); ++i) {
    EXPECT_EQ(split[i].rfind(config_keys()[i] + " ", 0), 0u) << split[i];
  }
  EXPECT_NE(items.find("model.head_dim unset"), std::string::npos) << items;
  EXPECT_NE(items.find("train.lr 0.003"), std::string::npos) << items;
  TrainConfig b = a;
  b.train.seed = 99;
  const std::string other = config_items(b);
  EXPECT_NE(other.find("train.seed 99"), std::string::npos) << other;
  EXPECT_EQ(other.size() + 2, items.size());  // 1234 -> 99
}

TEST(Config, OverridesSetEveryKind) {
  TrainConfig c;
  apply_overrides(
      c, std::vector<std::string>{
             "train.lr=3e-4", "train.steps=20", "model.head_dim=32", "train.recompute=true",
             "train.recompute_attention=true", "train.profile=true", "train.shard_optimizer=true",
             "parallel.layout=contiguous",
             "data.retrieval.pairs=16", "run.resume=latest", "data.train_path=a=b.h5",
             "train.seed=18446744073709551615", "run.backend=cpu", "data.source=hdf5"});
  EXPECT_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.train.steps, 20);
  EXPECT_EQ(c.model.head_dim, 32);
  EXPECT_EQ(c.model.resolved_head_dim(), 32);
  EXPECT_TRUE(c.train.recompute);
  EXPECT_TRUE(c.train.recompute_attention);
  EXPECT_TRUE(c.train.profile);
  EXPECT_TRUE(c.train.shard_optimizer);
  EXPECT_EQ(c.parallel.layout, ShardLayout::contiguous);
  EXPECT_EQ(c.data.retrieval.pairs, 16);
  EXPECT_EQ(c.run.resume, "latest");
  EXPECT_EQ(c.data.train_path, "a=b.h5");
  EXPECT_EQ(c.train.seed, 18446744073709551615ull);
  EXPECT_EQ(c.run.backend, Backend::cpu);
  EXPECT_EQ(c.data.source, DataSource::hdf5);
  apply_override(c, "run.resume=");
  EXPECT_EQ(c.run.resume, "");
}

// ---- errors while reading ---------------------------------------------------------------------

struct ReadCase {
  const char* name;
  const char* yaml;
  std::vector<std::string_view> parts;
};

void PrintTo(const ReadCase& c, std::ostream* out) {
  *out << c.name;
}

class ConfigReadError : public ::testing::TestWithParam<ReadCase> {};

TEST_P(ConfigReadError, NamesTheKeyAndWhatWasExpected) {
  const ReadCase& c = GetParam();
  try {
    load_config_string(c.yaml, "my.yaml");
    FAIL() << "no error for:\n" << c.yaml;
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string_view part : c.parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "missing \"" << part << "\" in: " << message;
    }
    EXPECT_EQ(error.kind(), ErrorKind::invalid_argument);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ConfigReadError,
    ::testing::Values(
        ReadCase{"typo",
                 "train:\n  lr: 1e-3\n  stpes: 10\n",
                 {"my.yaml:3: ", "unknown key 'train.stpes'", "did you mean 'train.steps'?"}},
        ReadCase{"wrong_section",
                 "model:\n  seq_len: 128\n",
                 {"unknown key 'model.seq_len'", "did you mean 'train.seq_len'?"}},
        ReadCase{"initials",
                 "train:\n  learning_rate: 1\n",
                 {"unknown key 'train.learning_rate'", "did you mean 'train.lr'?"}},
        ReadCase{"section_typo",
                 "trian:\n  steps: 1\n",
                 {"my.yaml:1: ", "unknown key 'trian'", "did you mean 'train'?"}},
        ReadCase{"nested_typo",
                 "data:\n  retrieval:\n    pairz: 3\n",
                 {"unknown key 'data.retrieval.pairz'", "did you mean 'data.retrieval.pairs'?"}},
        ReadCase{"no_near_key",
                 "foo:\n  bar: 1\n",
                 {"my.yaml:1: ", "unknown key 'foo'; the sections are model, train, parallel, "
                  "data, run"}},
        ReadCase{"no_near_key_in_section",
                 "data:\n  retrieval:\n    zzzzzzzzzz: 1\n",
                 {"unknown key 'data.retrieval.zzzzzzzzzz'; section 'data.retrieval' has pairs"}},
        ReadCase{"not_integer",
                 "train:\n  steps: abc\n",
                 {"my.yaml:2: ", "train.steps is 'abc'; expected an integer"}},
        ReadCase{"fraction_for_integer",
                 "train:\n  batch_size: 1.5\n",
                 {"train.batch_size is '1.5'; expected an integer"}},
        ReadCase{"negative_seed",
                 "train:\n  seed: -1\n",
                 {"train.seed is '-1'; expected a non-negative integer"}},
        ReadCase{"not_number", "train:\n  lr: fast\n", {"train.lr is 'fast'; expected a number"}},
        ReadCase{"infinite", "train:\n  lr: .inf\n", {"train.lr is '.inf'; expected a number"}},
        ReadCase{"not_bool",
                 "train:\n  recompute: yes\n",
                 {"train.recompute is 'yes'; expected true or false"}},
        ReadCase{"recompute_attention",
                 "train:\n  recompute_attention: 1\n",
                 {"my.yaml:2: ", "train.recompute_attention is '1'; expected true or false"}},
        ReadCase{"profile",
                 "train:\n  profile: on\n",
                 {"my.yaml:2: ", "train.profile is 'on'; expected true or false"}},
        ReadCase{"not_choice",
                 "parallel:\n  layout: zigzg\n",
                 {"parallel.layout is 'zigzg'; expected one of zigzag, contiguous"}},
        ReadCase{"backend",
                 "run:\n  backend: gpu\n",
                 {"run.backend is 'gpu'; expected one of auto, cuda, cpu"}},
        ReadCase{
            "map_for_value", "train:\n  lr: {a: 1}\n", {"train.lr is a map; expected a number"}},
        ReadCase{"list_for_value",
                 "parallel:\n  cp: [1, 2]\n",
                 {"parallel.cp is a list; expected an integer"}},
        ReadCase{
            "empty_number", "train:\n  steps:\n", {"train.steps is empty; expected an integer"}},
        ReadCase{"scalar_section",
                 "train: 5\n",
                 {"train is '5'; expected a map of keys such as 'train.seq_len'"}},
        ReadCase{"top_level_list", "- 1\n- 2\n", {"the document is a list"}},
        ReadCase{"duplicate",
                 "train:\n  lr: 1e-3\n  lr: 2e-3\n",
                 {"my.yaml:3: ", "key 'train.lr' is given twice (first on line 2)"}},
        ReadCase{"syntax", "train: [1, 2\n", {"my.yaml:", "YAML syntax error"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Config, MissingFileIsAnIoErrorNamingIt) {
  const test::TempDir dir;
  EXPECT_TRUE(throws_error_with([&] { load_config_file(dir / "nope.yaml"); },
                                {"config file '", "nope.yaml' does not exist"}, ErrorKind::io));
  EXPECT_TRUE(
      throws_error_with([&] { load_config_file(dir.path()); }, {"is a directory"}, ErrorKind::io));
}

TEST(Config, OverrideErrorsNameTheAssignment) {
  TrainConfig c;
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "train.lr"); },
                                {"--set 'train.lr' is not of the form key=value"}));
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "=3"); }, {"not of the form key=value"}));
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "train.stpes=1"); },
                                {"unknown key 'train.stpes'", "did you mean 'train.steps'?"}));
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "train=1"); },
                                {"'train' is a section", "'train.seq_len'"}));
  EXPECT_TRUE(
      throws_error_with([&] { apply_override(c, "train.steps=abc"); },
                        {"--set train.steps=abc", "train.steps is 'abc'; expected an integer"}));
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "lr=1"); }, {"did you mean 'train.lr'?"}));
  EXPECT_TRUE(
      throws_error_with([&] { apply_override(c, "train.profile=1"); },
                        {"--set train.profile=1", "train.profile is '1'; expected true or false"}));
  EXPECT_TRUE(c == TrainConfig{}) << "a failed override must not change the config";
}

// ---- validation ---------------------------------------------------------------------------------

struct ValidateCase {
  const char* name;
  std::function<void(TrainConfig&)> change;
  int world_size;
  std::vector<std::string_view> parts;
};

void PrintTo(const ValidateCase& c, std::ostream* out) {
  *out << c.name;
}

class ConfigValidateError : public ::testing::TestWithParam<ValidateCase> {};

TEST_P(ConfigValidateError, NamesTheKeysAndValues) {
  const ValidateCase& c = GetParam();
  TrainConfig config;
  c.change(config);
  try {
    validate(config, c.world_size);
    FAIL() << "no error for:\n" << dump_config(config);
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("validate_config: "), std::string::npos) << message;
    for (const std::string_view part : c.parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "missing \"" << part << "\" in: " << message;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ConfigValidateError,
    ::testing::Values(
        ValidateCase{"kv_heads",
                     [](TrainConfig& c) { c.model.n_kv_heads = 3; },
                     2,
                     {"model.n_heads (4) is not a multiple of model.n_kv_heads (3)"}},
        ValidateCase{"d_model_heads",
                     [](TrainConfig& c) {
                       c.model.n_heads = 3;
                       c.model.n_kv_heads = 1;
                     },
                     2,
                     {"model.d_model (64) is not a multiple of model.n_heads (3)", "head_dim"}},
        ValidateCase{"odd_head_dim",
                     [](TrainConfig& c) { c.model.head_dim = 15; },
                     2,
                     {"head dimension 15 (model.head_dim) is odd", "RoPE"}},
        ValidateCase{"v_head_dim",
                     [](TrainConfig& c) { c.model.v_head_dim = 0; },
                     2,
                     {"model.v_head_dim is 0; expected at least 1"}},
        ValidateCase{"zigzag_seq_len",
                     [](TrainConfig& c) { c.train.seq_len = 250; },
                     2,
                     {"train.seq_len (250) is not a multiple of 2 * parallel.cp = 4", "zigzag"}},
        ValidateCase{"contiguous_seq_len",
                     [](TrainConfig& c) {
                       c.parallel.layout = ShardLayout::contiguous;
                       c.parallel.cp = 3;
                       c.train.seq_len = 250;
                     },
                     3,
                     {"train.seq_len (250) is not a multiple of parallel.cp = 3", "contiguous"}},
        ValidateCase{"world_size",
                     [](TrainConfig&) {},
                     4,
                     {"parallel.dp x parallel.cp = 1 x 2 = 2 ranks, but the job has 4"}},
        ValidateCase{"vocab",
                     [](TrainConfig& c) { c.model.vocab_size = 1; },
                     2,
                     {"model.vocab_size is 1; expected at least 2"}},
        ValidateCase{"steps",
                     [](TrainConfig& c) { c.train.steps = 0; },
                     2,
                     {"train.steps is 0; expected at least 1"}},
        ValidateCase{"lr",
                     [](TrainConfig& c) { c.train.lr = 0.0; },
                     2,
                     {"train.lr is 0; expected a number > 0"}},
        ValidateCase{"min_lr",
                     [](TrainConfig& c) { c.train.min_lr = 0.01; },
                     2,
                     {"train.min_lr is 0.01; expected 0 <= min_lr <= train.lr (0.003)"}},
        ValidateCase{"beta2",
                     [](TrainConfig& c) { c.train.beta2 = 1.0; },
                     2,
                     {"train.beta2 is 1; expected 0 <= beta2 < 1"}},
        ValidateCase{"warmup",
                     [](TrainConfig& c) {
                       c.train.steps = 100;
                       c.train.warmup_steps = 101;
                     },
                     2,
                     {"train.warmup_steps (101) is more than train.steps (100)"}},
        ValidateCase{"grad_clip",
                     [](TrainConfig& c) { c.train.grad_clip = -1.0; },
                     2,
                     {"train.grad_clip is -1; expected at least 0"}},
        ValidateCase{"recompute_attention",
                     [](TrainConfig& c) { c.train.recompute_attention = true; },
                     2,
                     {"train.recompute_attention is true but train.recompute is false",
                      "set train.recompute to true or train.recompute_attention to false"}},
        ValidateCase{"loss_chunk",
                     [](TrainConfig& c) { c.train.loss_chunk_tokens = 0; },
                     2,
                     {"train.loss_chunk_tokens is 0; expected at least 1"}},
        ValidateCase{"mlp_chunk",
                     [](TrainConfig& c) { c.train.mlp_chunk_tokens = -1; },
                     2,
                     {"train.mlp_chunk_tokens is -1; expected at least 0"}},
        ValidateCase{"keep",
                     [](TrainConfig& c) { c.train.keep_checkpoints = 0; },
                     2,
                     {"train.keep_checkpoints is 0; expected at least 1"}},
        ValidateCase{"cp",
                     [](TrainConfig& c) { c.parallel.cp = 0; },
                     2,
                     {"parallel.cp is 0; expected at least 1"}},
        ValidateCase{"hdf5_paths",
                     [](TrainConfig& c) { c.data.source = DataSource::hdf5; },
                     2,
                     {"2 problems", "data.train_path is empty", "data.val_path is empty",
                      "train.eval_every = 50"}},
        ValidateCase{"retrieval_keys",
                     [](TrainConfig& c) {
                       c.data.retrieval.pairs = 64;
                       c.data.retrieval.queries = 1;
                     },
                     2,
                     {"data.retrieval.pairs (64) is more than the 63 distinct keys"}},
        ValidateCase{"retrieval_fit",
                     [](TrainConfig& c) {
                       c.data.retrieval.pairs = 8;
                       c.data.retrieval.queries = 8;
                       c.train.seq_len = 32;
                     },
                     2,
                     {"need 40 tokens", "train.seq_len + 1 = 33"}},
        ValidateCase{"retrieval_queries",
                     [](TrainConfig& c) {
                       c.data.retrieval.pairs = 8;
                       c.data.retrieval.queries = 9;
                     },
                     2,
                     {"data.retrieval.queries (9) is more than data.retrieval.pairs (8)"}},
        ValidateCase{"run_dir", [](TrainConfig& c) { c.run.dir.clear(); }, 2, {"run.dir is empty"}},
        ValidateCase{"several",
                     [](TrainConfig& c) {
                       c.train.lr = -1.0;
                       c.model.n_kv_heads = 3;
                       c.train.seq_len = 250;
                     },
                     2,
                     {"problems in the config:\n  ", "train.lr is -1", "model.n_kv_heads (3)",
                      "train.seq_len (250)"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Config, HeadDimGivenLiftsTheDivisibilityRule) {
  TrainConfig c;
  c.model.n_heads = 3;
  c.model.n_kv_heads = 1;
  c.model.head_dim = 32;
  EXPECT_NO_THROW(validate(c, 2));
  c.parallel.layout = ShardLayout::contiguous;
  c.parallel.cp = 3;
  c.train.seq_len = 255;
  EXPECT_NO_THROW(validate(c, 3));
}

// train.profile is off by default; a file or --set turns it on, and a dump (the checkpoint's
// config) keeps it. Its wrong types are among the read and override errors above.
TEST(Config, ProfileIsOffByDefaultAndRoundTrips) {
  EXPECT_FALSE(TrainConfig{}.train.profile);
  const TrainConfig c = load_config_string("train:\n  profile: true\n", "<yaml>");
  EXPECT_TRUE(c.train.profile);
  EXPECT_NO_THROW(validate(c, 2));
  const std::string yaml = dump_config(c);
  EXPECT_NE(yaml.find("profile: true"), std::string::npos) << yaml;
  EXPECT_TRUE(load_config_string(yaml, "<dump>") == c) << yaml;
  TrainConfig set;
  apply_override(set, "train.profile=true");
  EXPECT_TRUE(set == c);
  apply_override(set, "train.profile=false");
  EXPECT_TRUE(set == TrainConfig{});
}

// train.recompute_attention is off by default, and valid on with train.recompute (the
// combination without it is among the validation errors above).
TEST(Config, RecomputeAttentionGoesWithRecompute) {
  EXPECT_FALSE(TrainConfig{}.train.recompute_attention);
  const TrainConfig c =
      load_config_string("train:\n  recompute: true\n  recompute_attention: true\n", "<yaml>");
  EXPECT_TRUE(c.train.recompute);
  EXPECT_TRUE(c.train.recompute_attention);
  EXPECT_NO_THROW(validate(c, 2));
}

// The cuda backend's limits name the keys; the embedded GPU default passes them and the rules of
// every backend, at 1, 2 and 8 GPUs.
TEST(Config, CudaBackendLimitsNameTheKeys) {
  TrainConfig c;  // tiny-cpu: head dimension 64 / 4 = 16
  c.model.ffn_hidden = 175;
  EXPECT_TRUE(throws_error_with(
      [&] { validate_for_cuda(c); },
      {"model.d_model 64 / model.n_heads 4 gives head_dim 16",
       "the CUDA block takes " + test::built_cuda_head_dims_text(),
       "model.ffn_hidden is 175", "multiple of 8"}));
  c.run.backend = Backend::cuda;
  EXPECT_TRUE(throws_error_with([&] { validate(c, 2); }, {"gives head_dim 16"}));
  for (const int gpus : {1, 2, 8}) {
    const TrainConfig g = default_gpu_config(gpus);
    EXPECT_EQ(g.parallel.cp, gpus);
    EXPECT_EQ(g.run.backend, Backend::cuda);
    EXPECT_NO_THROW(validate(g, gpus)) << gpus << " GPUs";
  }
}

// A head dim the CUDA block has no kernels for is refused by validation when run.backend is cuda,
// before anything is built, naming the keys and values it comes from (d_model / n_heads, or
// model.head_dim when given); the cpu backend takes it, and the CUDA block's own head dims pass.
TEST(Config, CudaBackendRefusesHeadDimsWithoutKernels) {
  for (const int head_dim : {16, 48, 80, 160}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    TrainConfig c;
    c.model.n_heads = 8;
    c.model.n_kv_heads = 4;
    c.model.d_model = 8 * head_dim;
    EXPECT_NO_THROW(validate(c, 2));
    const std::string derived = "model.d_model " + std::to_string(8 * head_dim) +
                                " / model.n_heads 8 gives head_dim " + std::to_string(head_dim) +
                                "; the CUDA block takes " + test::built_cuda_head_dims_text();
    EXPECT_TRUE(
        throws_error_with([&] { validate_for_cuda(c); }, {derived}, ErrorKind::invalid_argument));
    c.run.backend = Backend::cuda;
    EXPECT_TRUE(throws_error_with([&] { validate(c, 2); }, {"validate_config: ", derived},
                                  ErrorKind::invalid_argument));

    // Given explicitly, model.head_dim is what counts (d_model / n_heads = 64 here).
    c.model.d_model = 512;
    c.model.head_dim = head_dim;
    EXPECT_TRUE(throws_error_with(
        [&] { validate(c, 2); },
        {"model.head_dim is " + std::to_string(head_dim) + "; the CUDA block takes " +
         test::built_cuda_head_dims_text()}));
    c.run.backend = Backend::cpu;
    EXPECT_NO_THROW(validate(c, 2));
  }
  for (const std::int64_t head_dim : test::kBuiltCudaHeadDims) {
    TrainConfig c;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 4;
    c.model.d_model = 4 * head_dim;
    c.run.backend = Backend::cuda;
    EXPECT_NO_THROW(validate(c, 2)) << "head_dim " << head_dim;
    c.model.d_model = 512;
    c.model.head_dim = head_dim;
    EXPECT_NO_THROW(validate(c, 2)) << "model.head_dim " << head_dim;
  }
}

// model.v_head_dim: absent, the head dimension (d_model / n_heads or model.head_dim); given, from
// a file or --set, V's own width, which may be odd (RoPE rotates q and k alone), and a dump keeps
// it.
TEST(Config, VHeadDimFollowsTheHeadDimUnlessGiven) {
  EXPECT_EQ(TrainConfig{}.model.resolved_v_head_dim(), 16);  // 64 / 4
  EXPECT_EQ(load_config_string("model:\n  head_dim: 32\n", "<yaml>").model.resolved_v_head_dim(),
            32);
  const TrainConfig file =
      load_config_string("model:\n  head_dim: 8\n  v_head_dim: 13\n", "<yaml>");
  EXPECT_EQ(file.model.v_head_dim, 13);
  EXPECT_EQ(file.model.resolved_head_dim(), 8);
  EXPECT_EQ(file.model.resolved_v_head_dim(), 13);
  EXPECT_NO_THROW(validate(file, 2));
  const std::string yaml = dump_config(file);
  EXPECT_NE(yaml.find("v_head_dim: 13"), std::string::npos) << yaml;
  EXPECT_TRUE(load_config_string(yaml, "<dump>") == file) << yaml;
  TrainConfig set;
  apply_overrides(set, std::vector<std::string>{"model.head_dim=8", "model.v_head_dim=13"});
  EXPECT_TRUE(set == file);
  EXPECT_NE(config_items(set).find("model.v_head_dim 13"), std::string::npos);
  EXPECT_TRUE(throws_error_with([&] { apply_override(set, "model.v_head_dim=wide"); },
                                {"model.v_head_dim", "wide"}));
}

// The CUDA block holds one head dim for Q K^T and P V, or 192 with 128: on the cuda backend any
// other model.v_head_dim than the head dimension is refused naming both values, whether the head
// dimension is given or derived; the same v_head_dim as the head dim passes (and 192/128 where
// the build has 192), and the cpu backend takes any.
TEST(Config, CudaBackendRefusesAVHeadDimOfItsOwn) {
  const std::int64_t head_dim = test::kBuiltCudaHeadDims[0];
  const std::string takes = "; the CUDA block takes d_v = d_qk";
  TrainConfig c;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.d_model = static_cast<int>(4 * head_dim);
  c.model.v_head_dim = static_cast<int>(head_dim + 8);
  EXPECT_NO_THROW(validate(c, 2));
  const std::string derived = "model.v_head_dim is " + std::to_string(head_dim + 8) +
                              " and the head dimension (model.d_model / model.n_heads) is " +
                              std::to_string(head_dim) + takes;
  EXPECT_TRUE(
      throws_error_with([&] { validate_for_cuda(c); }, {derived}, ErrorKind::invalid_argument));
  c.run.backend = Backend::cuda;
  EXPECT_TRUE(throws_error_with([&] { validate(c, 2); }, {"validate_config: ", derived},
                                ErrorKind::invalid_argument));
  c.model.d_model = 512;
  c.model.head_dim = static_cast<int>(head_dim);
  c.model.v_head_dim = 12;
  EXPECT_TRUE(
      throws_error_with([&] { validate(c, 2); },
                        {"model.v_head_dim is 12 and the head dimension (model.head_dim) is " +
                         std::to_string(head_dim) + takes}));
  c.model.v_head_dim = static_cast<int>(head_dim);
  EXPECT_NO_THROW(validate(c, 2));
  EXPECT_NO_THROW(validate_for_cuda(c));
  c.model.v_head_dim = 12;
  c.run.backend = Backend::cpu;
  EXPECT_NO_THROW(validate(c, 2));
  c.run.backend = Backend::cuda;
  c.model.head_dim = 192;
  c.model.v_head_dim = 128;
  if (ringattn::detail::cuda_block_takes_value_dim(192, 128)) {
    EXPECT_NO_THROW(validate(c, 2));
  } else {
    EXPECT_TRUE(throws_error_with([&] { validate(c, 2); }, {"model.v_head_dim is 128"}));
  }
  c.model.head_dim = 128;
  c.model.v_head_dim = 192;  // the pair the other way round has no kernels
  EXPECT_TRUE(throws_error_with(
      [&] { validate(c, 2); },
      {"model.v_head_dim is 192 and the head dimension (model.head_dim) is 128" + takes}));
}

// train.stages: a YAML list in a file, the same list through --set, read back from a dump; given
// without train.steps it sets train.steps to the stages' sum; stage_config and stage_of_step say
// what each step runs.
TEST(Config, StagesReadFromFilesAndOverrides) {
  const test::TempDir dir;
  const auto path = dir / "stages.yaml";
  std::ofstream(path) << "train:\n  batch_size: 8\n  stages:\n    - {steps: 40, seq_len: 64, "
                         "batch_size: 32}\n    - steps: 10\n      seq_len: 256\n";
  const TrainConfig c = load_config_file(path);
  ASSERT_EQ(c.train.stages.size(), 2u);
  EXPECT_TRUE((c.train.stages[0] == StageConfig{40, 64, 32}));
  EXPECT_TRUE((c.train.stages[1] == StageConfig{10, 256, std::nullopt}));
  EXPECT_EQ(c.train.steps, 50);
  EXPECT_NO_THROW(validate(c, 2));
  EXPECT_TRUE(load_config_string(dump_config(c), "<dump>") == c) << dump_config(c);
  EXPECT_NE(dump_config(c).find("stages: [{steps: 40, seq_len: 64, batch_size: 32}"),
            std::string::npos)
      << dump_config(c);

  TrainConfig o;
  apply_overrides(o, std::vector<std::string>{
                         "train.stages=[{steps: 40, seq_len: 64, batch_size: 32}, {steps: 10, "
                         "seq_len: 256}]",
                         "train.batch_size=8"});
  EXPECT_TRUE(o == c) << dump_config(o);
  // train.steps given beside the stages stays as given (validate then compares them).
  TrainConfig both;
  apply_overrides(both, std::vector<std::string>{"train.steps=7", "train.stages=[{steps: 3, "
                                                                   "seq_len: 64}]"});
  EXPECT_EQ(both.train.steps, 7);
  // An empty list is no stages.
  apply_overrides(o, std::vector<std::string>{"train.stages=[]"});
  EXPECT_TRUE(o.train.stages.empty());

  EXPECT_EQ(stage_config(c, 0).train.seq_len, 64);
  EXPECT_EQ(stage_config(c, 0).train.batch_size, 32);
  EXPECT_EQ(stage_config(c, 1).train.seq_len, 256);
  EXPECT_EQ(stage_config(c, 1).train.batch_size, 8);
  EXPECT_EQ(stage_of_step(c.train, 0), 0);
  EXPECT_EQ(stage_of_step(c.train, 39), 0);
  EXPECT_EQ(stage_of_step(c.train, 40), 1);
  EXPECT_EQ(stage_of_step(c.train, 49), 1);
  EXPECT_EQ(stage_of_step(c.train, 50), 1);
  // Without stages, one stage of the run's own steps, seq_len and batch size.
  const TrainConfig plain;
  ASSERT_EQ(run_stages(plain.train).size(), 1u);
  EXPECT_TRUE((run_stages(plain.train)[0] ==
               StageConfig{plain.train.steps, plain.train.seq_len, plain.train.batch_size}));
  EXPECT_EQ(stage_of_step(plain.train, 5), 0);
}

// Malformed stages name the key and the form expected; every stage is validated as it will run,
// its problems naming it, and the sum must match train.steps.
TEST(Config, StageErrorsNameTheStage) {
  for (const char* text : {"train.stages=[{steps: 4}]", "train.stages=[{steps: 4, seq_len: 64, "
                                                          "lr: 1}]",
                           "train.stages=[{steps: four, seq_len: 64}]", "train.stages=7",
                           "train.stages=[[4, 64]]"}) {
    TrainConfig c;
    EXPECT_TRUE(throws_error_with([&] { apply_overrides(c, std::vector<std::string>{text}); },
                                  {"--set ", "train.stages is '",
                                   "expected a list of stages, each {steps: N, seq_len: N}"}))
        << text;
  }
  const test::TempDir dir;
  const auto path = dir / "bad.yaml";
  std::ofstream(path) << "train:\n  stages:\n    - {steps: 4, seq_len: [64]}\n";
  EXPECT_TRUE(throws_error_with([&] { load_config_file(path); },
                                {"bad.yaml:3", "train.stages is", "expected a list of stages"}));

  TrainConfig c;
  c.parallel.cp = 2;  // zigzag: seq_len a multiple of 4
  c.data.retrieval.pairs = 4;  // 4 pairs and 4 queries fit in 66 tokens, not in 4
  c.data.retrieval.queries = 4;
  c.train.stages = {StageConfig{0, 64, std::nullopt}, StageConfig{5, 66, 0},
                    StageConfig{5, 4, std::nullopt}};
  c.train.steps = 12;
  EXPECT_TRUE(throws_error_with(
      [&] { validate(c, 2); },
      {"train.stages[0].steps is 0; expected at least 1",
       "train.stages[1].batch_size is 0; expected at least 1",
       "train.stages add up to 10 steps but train.steps is 12",
       "train.stages[2] (seq_len 4): the retrieval task's 4 pairs"}));
  c.train.stages[1].batch_size = 2;
  EXPECT_TRUE(throws_error_with(
      [&] { validate(c, 2); },
      {"train.stages[1] (seq_len 66): train.seq_len (66) is not a multiple of 2 * parallel.cp = 4"}));
}

}  // namespace
}  // namespace ringattn::train
