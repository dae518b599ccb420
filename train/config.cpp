// Every key is one row of a table (its dotted name and an accessor into TrainConfig); reading a
// file, `--set`, dumping and the unknown-key suggestions all walk that table, so a new key is one
// new row plus its range check in validate().
#include "train/config.hpp"

#include <yaml-cpp/yaml.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>
#include <utility>

#include "kernels/block_checks.hpp"
#include "ringattn/error.hpp"
#include "train/retrieval_task.hpp"

namespace ringattn::train {
namespace {

// ---- values: text <-> typed, one overload set per type --------------------------------------

template <typename Enum>
struct EnumName {
  std::string_view name;
  Enum value;
};

constexpr EnumName<ShardLayout> kLayoutNames[] = {{"zigzag", ShardLayout::zigzag},
                                                  {"contiguous", ShardLayout::contiguous},
                                                  {"balanced", ShardLayout::balanced}};
constexpr EnumName<DataSource> kSourceNames[] = {{"hdf5", DataSource::hdf5},
                                                 {"retrieval", DataSource::retrieval}};
constexpr EnumName<Backend> kBackendNames[] = {
    {"auto", Backend::automatic}, {"cuda", Backend::cuda}, {"cpu", Backend::cpu}};

std::span<const EnumName<ShardLayout>> enum_names(ShardLayout) {
  return kLayoutNames;
}
std::span<const EnumName<DataSource>> enum_names(DataSource) {
  return kSourceNames;
}
std::span<const EnumName<Backend>> enum_names(Backend) {
  return kBackendNames;
}
constexpr EnumName<Offload> kOffloadNames[] = {
    {"auto", Offload::automatic}, {"on", Offload::on}, {"off", Offload::off}};
std::span<const EnumName<Offload>> enum_names(Offload) {
  return kOffloadNames;
}

template <typename T>
bool parse_integer(std::string_view text, T& out) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) return false;
  out = value;
  return true;
}

bool parse_value(std::string_view text, int& out) {
  return parse_integer(text, out);
}
bool parse_value(std::string_view text, std::uint64_t& out) {
  return parse_integer(text, out);
}
bool parse_value(std::string_view text, std::optional<int>& out) {
  int value = 0;
  if (!parse_integer(text, value)) return false;
  out = value;
  return true;
}
bool parse_value(std::string_view text, double& out) {
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty() ||
      !std::isfinite(value)) {
    return false;
  }
  out = value;
  return true;
}
bool parse_value(std::string_view text, bool& out) {
  // YAML 1.2's core schema spellings.
  if (text == "true" || text == "True" || text == "TRUE") {
    out = true;
    return true;
  }
  if (text == "false" || text == "False" || text == "FALSE") {
    out = false;
    return true;
  }
  return false;
}
bool parse_value(std::string_view text, std::optional<bool>& out) {
  bool value = false;
  if (!parse_value(text, value)) return false;
  out = value;
  return true;
}
bool parse_value(std::string_view text, std::string& out) {
  out = std::string(text);
  return true;
}
// train.stages: a YAML list of maps {steps, seq_len[, batch_size]}, from a file's node (as its
// YAML text) or from `--set train.stages=[{steps: 400, seq_len: 256}, ...]`. Null or "" is no
// stages. Ranges are validate()'s job; this only takes the shape.
bool parse_value(std::string_view text, std::vector<StageConfig>& out) {
  YAML::Node node;
  try {
    node = YAML::Load(std::string(text));
  } catch (const YAML::Exception&) {
    return false;
  }
  std::vector<StageConfig> stages;
  if (node.IsNull()) {
    out = stages;
    return true;
  }
  if (!node.IsSequence()) return false;
  for (const YAML::Node& entry : node) {
    if (!entry.IsMap()) return false;
    StageConfig stage;
    bool has_steps = false, has_seq_len = false;
    for (const auto& field : entry) {
      const std::string key = field.first.Scalar();
      if (!field.second.IsScalar()) return false;
      int value = 0;
      if (!parse_integer(std::string_view(field.second.Scalar()), value)) return false;
      if (key == "steps" && !has_steps) {
        stage.steps = value;
        has_steps = true;
      } else if (key == "seq_len" && !has_seq_len) {
        stage.seq_len = value;
        has_seq_len = true;
      } else if (key == "batch_size" && !stage.batch_size) {
        stage.batch_size = value;
      } else {
        return false;
      }
    }
    if (!has_steps || !has_seq_len) return false;
    stages.push_back(stage);
  }
  out = std::move(stages);
  return true;
}

template <typename Enum, std::enable_if_t<std::is_enum_v<Enum>, int> = 0>
bool parse_value(std::string_view text, Enum& out) {
  for (const auto& entry : enum_names(Enum{})) {
    if (entry.name == text) {
      out = entry.value;
      return true;
    }
  }
  return false;
}

std::string format_value(int value) {
  return std::to_string(value);
}
std::string format_value(std::uint64_t value) {
  return std::to_string(value);
}
std::string format_value(bool value) {
  return value ? "true" : "false";
}
std::string format_value(const std::string& value) {
  return value;
}
// The shortest text that reads back as the same double, with a '.' in the mantissa of the
// exponent form ("3.0e-04", not "3e-04"), which YAML 1.1 readers (PyYAML) need to see a float.
std::string format_value(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  std::string text(buffer, result.ptr);
  const auto exponent = text.find('e');
  if (exponent != std::string::npos && text.find('.') == std::string::npos) {
    text.insert(exponent, ".0");
  }
  return text;
}
// YAML flow text that parse_value reads back: [{steps: 400, seq_len: 256}, ...].
std::string format_value(const std::vector<StageConfig>& stages) {
  std::string text = "[";
  for (const StageConfig& stage : stages) {
    if (text.size() > 1) text += ", ";
    text += "{steps: " + std::to_string(stage.steps) + ", seq_len: " + std::to_string(stage.seq_len);
    if (stage.batch_size) text += ", batch_size: " + std::to_string(*stage.batch_size);
    text += "}";
  }
  return text + "]";
}
template <typename Enum>
std::string_view enum_name(Enum value) {
  for (const auto& entry : enum_names(Enum{})) {
    if (entry.value == value) return entry.name;
  }
  return "?";
}
template <typename Enum, std::enable_if_t<std::is_enum_v<Enum>, int> = 0>
std::string format_value(Enum value) {
  return std::string(enum_name(value));
}

template <typename T>
std::string expected_text() {
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, std::optional<int>>) {
    return "an integer";
  } else if constexpr (std::is_same_v<T, std::uint64_t>) {
    return "a non-negative integer";
  } else if constexpr (std::is_same_v<T, double>) {
    return "a number";
  } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) {
    return "true or false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return "a string";
  } else if constexpr (std::is_same_v<T, std::vector<StageConfig>>) {
    return "a list of stages, each {steps: N, seq_len: N} with an optional batch_size: N, e.g. "
           "[{steps: 400, seq_len: 256}, {steps: 200, seq_len: 16384}]";
  } else {
    std::string text = "one of";
    const char* separator = " ";
    for (const auto& entry : enum_names(T{})) {
      text += separator;
      text += entry.name;
      separator = ", ";
    }
    return text;
  }
}

// ---- the key table ------------------------------------------------------------------------------

struct KeyInfo {
  std::string key;
  std::string expected;  // "an integer", "one of zigzag, contiguous", ...
  bool is_text = false;  // a string: YAML null reads as "", dumps are always quoted
  bool is_list = false;  // YAML flow text of a list (train.stages): read from a list node, dumped as one
  std::function<bool(TrainConfig&, std::string_view)> parse;             // false: not of the type
  std::function<std::optional<std::string>(const TrainConfig&)> format;  // nullopt: unset
};

template <typename Access>
KeyInfo make_key(std::string key, Access access) {
  using Value = std::remove_cvref_t<decltype(access(std::declval<TrainConfig&>()))>;
  KeyInfo info;
  info.key = std::move(key);
  info.expected = expected_text<Value>();
  info.is_text = std::is_same_v<Value, std::string>;
  info.is_list = std::is_same_v<Value, std::vector<StageConfig>>;
  info.parse = [access](TrainConfig& config, std::string_view text) {
    return parse_value(text, access(config));
  };
  info.format = [access](const TrainConfig& config) -> std::optional<std::string> {
    const auto& value = access(config);
    if constexpr (std::is_same_v<Value, std::optional<int>> ||
                  std::is_same_v<Value, std::optional<bool>>) {
      if (!value) return std::nullopt;
      return format_value(*value);
    } else if constexpr (std::is_same_v<Value, std::vector<StageConfig>>) {
      if (value.empty()) return std::nullopt;
      return format_value(value);
    } else {
      return format_value(value);
    }
  };
  return info;
}

// One row: the key's dotted name is also its member path in TrainConfig, so it is written once.
// clang-format off
#define RINGATTN_CONFIG_KEY(path) make_key(#path, [](auto& c) -> auto& { return c.path; })
// clang-format on

const std::vector<KeyInfo>& key_table() {
  static const std::vector<KeyInfo> table = {
      RINGATTN_CONFIG_KEY(model.vocab_size),
      RINGATTN_CONFIG_KEY(model.d_model),
      RINGATTN_CONFIG_KEY(model.n_layers),
      RINGATTN_CONFIG_KEY(model.n_heads),
      RINGATTN_CONFIG_KEY(model.n_kv_heads),
      RINGATTN_CONFIG_KEY(model.head_dim),
      RINGATTN_CONFIG_KEY(model.v_head_dim),
      RINGATTN_CONFIG_KEY(model.ffn_hidden),
      RINGATTN_CONFIG_KEY(model.tied_embeddings),
      RINGATTN_CONFIG_KEY(model.rope_theta),
      RINGATTN_CONFIG_KEY(model.norm_eps),
      RINGATTN_CONFIG_KEY(model.init_std),
      RINGATTN_CONFIG_KEY(model.attention_window),
      RINGATTN_CONFIG_KEY(model.rope_document_positions),
      RINGATTN_CONFIG_KEY(train.seq_len),
      RINGATTN_CONFIG_KEY(train.batch_size),
      RINGATTN_CONFIG_KEY(train.grad_accum),
      RINGATTN_CONFIG_KEY(train.steps),
      RINGATTN_CONFIG_KEY(train.stages),
      RINGATTN_CONFIG_KEY(train.lr),
      RINGATTN_CONFIG_KEY(train.min_lr),
      RINGATTN_CONFIG_KEY(train.warmup_steps),
      RINGATTN_CONFIG_KEY(train.weight_decay),
      RINGATTN_CONFIG_KEY(train.beta1),
      RINGATTN_CONFIG_KEY(train.beta2),
      RINGATTN_CONFIG_KEY(train.adam_eps),
      RINGATTN_CONFIG_KEY(train.grad_clip),
      RINGATTN_CONFIG_KEY(train.seed),
      RINGATTN_CONFIG_KEY(train.recompute),
      RINGATTN_CONFIG_KEY(train.recompute_attention),
      RINGATTN_CONFIG_KEY(train.loss_chunk_tokens),
      RINGATTN_CONFIG_KEY(train.mlp_chunk_tokens),
      RINGATTN_CONFIG_KEY(train.offload),
      RINGATTN_CONFIG_KEY(train.deterministic),
      RINGATTN_CONFIG_KEY(train.profile),
      RINGATTN_CONFIG_KEY(train.shard_optimizer),
      RINGATTN_CONFIG_KEY(train.log_every),
      RINGATTN_CONFIG_KEY(train.eval_every),
      RINGATTN_CONFIG_KEY(train.eval_batches),
      RINGATTN_CONFIG_KEY(train.checkpoint_every),
      RINGATTN_CONFIG_KEY(train.keep_checkpoints),
      RINGATTN_CONFIG_KEY(parallel.dp),
      RINGATTN_CONFIG_KEY(parallel.cp),
      RINGATTN_CONFIG_KEY(parallel.layout),
      RINGATTN_CONFIG_KEY(parallel.local_attention),
      RINGATTN_CONFIG_KEY(data.source),
      RINGATTN_CONFIG_KEY(data.train_path),
      RINGATTN_CONFIG_KEY(data.val_path),
      RINGATTN_CONFIG_KEY(data.documents),
      RINGATTN_CONFIG_KEY(data.retrieval.pairs),
      RINGATTN_CONFIG_KEY(data.retrieval.key_tokens),
      RINGATTN_CONFIG_KEY(data.retrieval.value_tokens),
      RINGATTN_CONFIG_KEY(data.retrieval.queries),
      RINGATTN_CONFIG_KEY(run.dir),
      RINGATTN_CONFIG_KEY(run.backend),
      RINGATTN_CONFIG_KEY(run.resume),
  };
  return table;
}

#undef RINGATTN_CONFIG_KEY

const KeyInfo* find_key(std::string_view key) {
  for (const KeyInfo& info : key_table()) {
    if (info.key == key) return &info;
  }
  return nullptr;
}

// A section is a strict prefix of keys: "train", "data", "data.retrieval".
bool is_section(std::string_view name) {
  return std::any_of(key_table().begin(), key_table().end(), [&](const KeyInfo& info) {
    return info.key.size() > name.size() && info.key.starts_with(name) &&
           info.key[name.size()] == '.';
  });
}

std::string first_key_of(std::string_view section) {
  for (const KeyInfo& info : key_table()) {
    if (info.key.starts_with(std::string(section) + ".")) return info.key;
  }
  return {};
}

// ---- unknown keys: the nearest known one --------------------------------------------------------

// Optimal string alignment distance: edits are insertions, deletions, substitutions and swaps
// of neighbours (the usual typos).
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string_view leaf_of(std::string_view key) {
  const auto dot = key.rfind('.');
  return dot == std::string_view::npos ? key : key.substr(dot + 1);
}

// "learning_rate" -> "lr": the first letter of each word.
std::string initials(std::string_view name) {
  std::string letters;
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (name[i] != '_' && (i == 0 || name[i - 1] == '_')) letters += name[i];
  }
  return letters;
}

// A key whose last part is the same as the unknown one's (in another section: "model.seq_len" ->
// "train.seq_len") first, then a key of the same section named by its initials
// ("train.learning_rate" -> "train.lr"; initials are too short to point into another section:
// "model.dropout_probability" is not "parallel.dp"), else the key or section with the fewest
// edits; "" when even that one is too far to be a typo (more edits than a third of the unknown
// name's length, and more than 2).
std::string nearest_name(std::string_view unknown) {
  const std::string_view leaf = leaf_of(unknown);
  for (const KeyInfo& info : key_table()) {
    if (leaf_of(info.key) == leaf) return info.key;
  }
  if (leaf.find('_') != std::string_view::npos) {
    const std::string same_section =
        std::string(unknown.substr(0, unknown.size() - leaf.size())) + initials(leaf);
    if (find_key(same_section) != nullptr) return same_section;
  }
  std::vector<std::string> names;
  for (const KeyInfo& info : key_table()) {
    names.push_back(info.key);
    for (auto dot = info.key.find('.'); dot != std::string::npos;
         dot = info.key.find('.', dot + 1)) {
      names.push_back(info.key.substr(0, dot));
    }
  }
  std::string best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const std::string& name : names) {
    const std::size_t distance = edit_distance(unknown, name);
    if (distance < best_distance) {
      best = name;
      best_distance = distance;
    }
  }
  return best_distance <= std::max<std::size_t>(2, unknown.size() / 3) ? best : std::string{};
}

// Without a near name: the keys of the unknown key's section where that is a section, else the
// top-level sections.
std::string unknown_key_message(std::string_view key) {
  const std::string near = nearest_name(key);
  if (!near.empty()) return detail::concat("unknown key '", key, "'; did you mean '", near, "'?");
  const auto dot = key.rfind('.');
  const std::string section(dot == std::string_view::npos ? "" : key.substr(0, dot));
  const bool in_section = !section.empty() && is_section(section);
  const std::string prefix = section + ".";
  std::vector<std::string> names;
  for (const KeyInfo& info : key_table()) {
    if (in_section && !info.key.starts_with(prefix)) continue;
    const std::string name =
        in_section ? info.key.substr(prefix.size()) : info.key.substr(0, info.key.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  std::string list;
  for (const std::string& name : names) list += (list.empty() ? "" : ", ") + name;
  return in_section
             ? detail::concat("unknown key '", key, "'; section '", section, "' has ", list)
             : detail::concat("unknown key '", key, "'; the sections are ", list);
}

// ---- reading YAML -------------------------------------------------------------------------------

std::string node_kind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "empty";
    default:
      return "'" + node.Scalar() + "'";
  }
}

class YamlReader {
 public:
  YamlReader(std::string source, TrainConfig& config)
      : source_(std::move(source)), config_(config) {}

  void read_document(const YAML::Node& root) {
    if (root.IsNull()) {
      // An empty file, or one of comments only, is most likely the wrong file: running the
      // defaults instead would hide that.
      detail::fail("load_config", source_,
                   ": the config sets no key (the file is empty or holds only comments); expected "
                   "a map of sections (model, train, parallel, data, run). Run without a config "
                   "file for the embedded default");
    }
    if (!root.IsMap()) {
      fail_at(root, "the document is ", node_kind(root),
              "; expected a map of sections (model, "
              "train, parallel, data, run)");
    }
    read_map(root, "");
  }

 private:
  template <typename... Parts>
  [[noreturn]] void fail_at(const YAML::Node& node, const Parts&... parts) {
    detail::fail("load_config", source_, ":", node.Mark().line + 1, ": ", parts...);
  }

  void read_map(const YAML::Node& map, const std::string& prefix) {
    for (const auto& entry : map) {
      const std::string name =
          prefix.empty() ? entry.first.Scalar() : prefix + "." + entry.first.Scalar();
      const YAML::Node& value = entry.second;
      const auto [previous, inserted] = lines_.emplace(name, entry.first.Mark().line + 1);
      if (!inserted) {
        fail_at(entry.first, "key '", name, "' is given twice (first on line ", previous->second,
                ")");
      }
      if (const KeyInfo* info = find_key(name)) {
        read_value(*info, value);
      } else if (is_section(name)) {
        if (value.IsMap()) {
          read_map(value, name);
        } else if (!value.IsNull()) {
          fail_at(value, name, " is ", node_kind(value), "; expected a map of keys such as '",
                  first_key_of(name), "'");
        }
      } else {
        fail_at(entry.first, unknown_key_message(name));
      }
    }
  }

  void read_value(const KeyInfo& info, const YAML::Node& value) {
    if (value.IsNull() && info.is_text) {
      info.parse(config_, "");
      return;
    }
    if (info.is_list && (value.IsSequence() || value.IsNull())) {
      YAML::Emitter text;
      text << YAML::Flow << value;
      if (!info.parse(config_, text.c_str())) {
        fail_at(value, info.key, " is ", text.c_str(), "; expected ", info.expected);
      }
      return;
    }
    if (!value.IsScalar()) {
      fail_at(value, info.key, " is ", node_kind(value), "; expected ", info.expected);
    }
    if (!info.parse(config_, value.Scalar())) {
      fail_at(value, info.key, " is '", value.Scalar(), "'; expected ", info.expected);
    }
  }

  std::string source_;
  TrainConfig& config_;
  std::map<std::string, int> lines_;  // key -> line where it was first given

 public:
  bool given(const std::string& key) const { return lines_.contains(key); }
};

int stage_steps_sum(const std::vector<StageConfig>& stages) {
  std::int64_t sum = 0;
  for (const StageConfig& stage : stages) sum += stage.steps;
  return static_cast<int>(std::clamp<std::int64_t>(sum, 0, std::numeric_limits<int>::max()));
}

// ---- reading the file ---------------------------------------------------------------------------

template <typename... Parts>
[[noreturn]] void fail_config_file(const std::string& name, const Parts&... parts) {
  detail::fail_as(ErrorKind::io, "load_config", "config file '", name, "' ", parts...);
}

// What a path that is no regular file is: "a FIFO, not a regular file".
const char* not_a_regular_file(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO, not a regular file";
  if (S_ISCHR(mode)) return "a character device, not a regular file";
  if (S_ISBLK(mode)) return "a block device, not a regular file";
  if (S_ISSOCK(mode)) return "a socket, not a regular file";
  return "not a regular file";
}

// The file's bytes. It is opened without waiting and refused unless it is a regular file before a
// byte is read: the read of a FIFO or a terminal would wait for a writer forever. read(2) tells a
// failed read (EIO: /proc/self/mem) from the end of the file, which a stream's rdbuf() does not.
std::string read_config_file(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) fail_config_file(name, "does not exist");
    fail_config_file(name, "could not be read: ", std::strerror(errno));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) fail_config_file(name, "could not be read: ", std::strerror(errno));
  if (S_ISDIR(info.st_mode)) fail_config_file(name, "is a directory; expected a YAML file");
  if (!S_ISREG(info.st_mode)) {
    fail_config_file(name, "is ", not_a_regular_file(info.st_mode), "; expected a YAML file");
  }
  std::string text;
  char block[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, block, sizeof block);
    if (got == 0) return text;
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_config_file(name, "could not be read: ", std::strerror(errno));
    text.append(block, static_cast<std::size_t>(got));
  }
}

// ---- validation ---------------------------------------------------------------------------------

class Problems {
 public:
  template <typename T>
  void at_least(std::string_view key, T value, T min) {
    if (!(value >= min))
      add(key, " is ", format_value(value), "; expected at least ", format_value(min));
  }
  void positive(std::string_view key, double value) {
    if (!(value > 0.0)) add(key, " is ", format_value(value), "; expected a number > 0");
  }
  void unit_interval(std::string_view key, double value) {
    if (!(value >= 0.0 && value < 1.0)) {
      add(key, " is ", format_value(value), "; expected 0 <= ", leaf_of(key), " < 1");
    }
  }
  // A problem that two checks find (train.seq_len 0: the range and the retrieval task) is said
  // once.
  template <typename... Parts>
  void add(const Parts&... parts) {
    std::string line = detail::concat(parts...);
    if (std::find(lines_.begin(), lines_.end(), line) == lines_.end()) {
      lines_.push_back(std::move(line));
    }
  }
  void throw_if_any() const {
    if (lines_.empty()) return;
    if (lines_.size() == 1) detail::fail("validate_config", lines_.front());
    std::string text = std::to_string(lines_.size()) + " problems in the config:";
    for (const std::string& line : lines_) text += "\n  " + line;
    detail::fail("validate_config", text);
  }

 private:
  std::vector<std::string> lines_;
};

}  // namespace

// ---- public -------------------------------------------------------------------------------------

std::string_view source_name(DataSource source) {
  return enum_name(source);
}
std::string_view backend_name(Backend backend) {
  return enum_name(backend);
}

const std::vector<std::string>& config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> names;
    for (const KeyInfo& info : key_table()) names.push_back(info.key);
    return names;
  }();
  return keys;
}

std::string config_items(const TrainConfig& config) {
  std::string items;
  for (const KeyInfo& info : key_table()) {
    const std::optional<std::string> text = info.format(config);
    items += (items.empty() ? "" : "; ") + info.key + " " + (text ? *text : std::string("unset"));
  }
  return items;
}

TrainConfig load_config_string(std::string_view yaml, std::string_view source) {
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(std::string(yaml));
  } catch (const YAML::Exception& error) {
    detail::fail("load_config", source, ":", error.mark.line + 1, ":", error.mark.column + 1,
                 ": YAML syntax error: ", error.msg);
  }
  // A config is one document: the keys of a second one (after "---") would otherwise be dropped
  // without a word.
  if (documents.size() > 1) {
    detail::fail("load_config", source, ":", documents[1].Mark().line + 1,
                 ": a second YAML document begins here (after '---'); a config file holds one "
                 "document: remove the '---' to keep its keys, or what follows it");
  }
  TrainConfig config;
  YamlReader reader(std::string(source), config);
  reader.read_document(documents.empty() ? YAML::Node() : documents.front());
  if (reader.given("train.stages") && !reader.given("train.steps")) {
    config.train.steps = stage_steps_sum(config.train.stages);
  }
  return config;
}

TrainConfig load_config_file(const std::filesystem::path& path) {
  return load_config_string(read_config_file(path), path.string());
}

void apply_override(TrainConfig& config, std::string_view assignment) {
  const auto equals = assignment.find('=');
  if (equals == std::string_view::npos || equals == 0) {
    detail::fail("apply_override", "--set '", assignment,
                 "' is not of the form key=value (e.g. "
                 "train.lr=3e-4)");
  }
  const std::string_view key = assignment.substr(0, equals);
  const std::string_view text = assignment.substr(equals + 1);
  const KeyInfo* info = find_key(key);
  if (info == nullptr) {
    if (is_section(key)) {
      detail::fail("apply_override", "--set ", assignment, ": '", key,
                   "' is a section; --set takes a whole key such as '", first_key_of(key), "'");
    }
    detail::fail("apply_override", "--set ", assignment, ": ", unknown_key_message(key));
  }
  if (!info->parse(config, text)) {
    detail::fail("apply_override", "--set ", assignment, ": ", key, " is '", text, "'; expected ",
                 info->expected);
  }
}

void apply_overrides(TrainConfig& config, std::span<const std::string> assignments) {
  // train.stages given without train.steps sets train.steps to the stages' sum, whatever the
  // order of the assignments; a train.steps given beside them stays as given.
  bool stages = false, steps = false;
  for (const std::string& assignment : assignments) {
    apply_override(config, assignment);
    stages |= assignment.starts_with("train.stages=");
    steps |= assignment.starts_with("train.steps=");
  }
  if (stages && !steps) config.train.steps = stage_steps_sum(config.train.stages);
}

std::string dump_config(const TrainConfig& config) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // the sections now open, outermost first
  for (const KeyInfo& info : key_table()) {
    const std::optional<std::string> text = info.format(config);
    if (!text) continue;
    std::vector<std::string> parts;
    std::stringstream stream(info.key);
    for (std::string part; std::getline(stream, part, '.');) parts.push_back(part);
    const std::vector<std::string> sections(parts.begin(), parts.end() - 1);
    std::size_t common = 0;
    while (common < open.size() && common < sections.size() && open[common] == sections[common]) {
      ++common;
    }
    for (; open.size() > common; open.pop_back()) out << YAML::EndMap;
    for (; open.size() < sections.size(); open.push_back(sections[open.size()])) {
      out << YAML::Key << sections[open.size()] << YAML::Value << YAML::BeginMap;
    }
    out << YAML::Key << parts.back() << YAML::Value;
    if (info.is_list) {
      out << YAML::Flow << YAML::Load(*text);
      continue;
    }
    // Quoted, so that a path like "null", "~" or "true" stays a string.
    if (info.is_text) out << YAML::DoubleQuoted;
    out << *text;
  }
  for (; !open.empty(); open.pop_back()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

namespace {

// What the CUDA backend needs beyond the model's own rules: a head dimension its attention block
// has kernels for (kernels/block_checks.hpp holds the list), and GEMM dimensions that are
// multiples of 8 (16-byte rows of bf16).
void add_cuda_problems(const TrainConfig& config, Problems& p) {
  const ModelConfig& m = config.model;
  const std::string takes = "the CUDA block takes " + detail::cuda_block_head_dims_text();
  if (m.head_dim) {
    if (*m.head_dim >= 1 && !detail::cuda_block_takes_head_dim(*m.head_dim)) {
      p.add("model.head_dim is ", *m.head_dim, "; ", takes);
    }
  } else if (m.d_model >= 1 && m.n_heads >= 1 && m.d_model % m.n_heads == 0 &&
             !detail::cuda_block_takes_head_dim(m.d_model / m.n_heads)) {
    p.add("model.d_model ", m.d_model, " / model.n_heads ", m.n_heads, " gives head_dim ",
          m.d_model / m.n_heads, "; ", takes,
          " (choose model.n_heads or set model.head_dim to one of them)");
  }
  // The kernels hold one head dim for Q K^T and P V, or a pair of their own
  // (kernels/block_checks.cpp).
  if (m.v_head_dim && m.n_heads >= 1 && *m.v_head_dim != m.resolved_head_dim() &&
      !detail::cuda_block_takes_value_dim(m.resolved_head_dim(), *m.v_head_dim)) {
    const std::string pairs = detail::cuda_block_value_dims_text();
    p.add("model.v_head_dim is ", *m.v_head_dim, " and the head dimension ",
          m.head_dim ? "(model.head_dim) is " : "(model.d_model / model.n_heads) is ",
          m.resolved_head_dim(), "; the CUDA block takes d_v = d_qk, one head dim for q, k and v",
          pairs.empty() ? "" : ", or " + pairs,
          " (another model.v_head_dim runs on the cpu backend)");
  }
  const auto multiple_of_8 = [&](const char* key, std::int64_t value) {
    if (value >= 1 && value % 8 != 0) {
      p.add(key, " is ", value, "; the cuda backend needs a multiple of 8");
    }
  };
  multiple_of_8("model.d_model", m.d_model);
  multiple_of_8("model.ffn_hidden", m.ffn_hidden);
  multiple_of_8("model.vocab_size", m.vocab_size);
}

// What depends on the sequence length: its multiple of the layout's chunks and the retrieval task
// fitting in it. `prefix` names the stage ("" for a run without train.stages).
void add_sequence_problems(const TrainConfig& config, const std::string& prefix, Problems& p) {
  const TrainingConfig& t = config.train;
  const ParallelConfig& par = config.parallel;
  if (par.cp >= 1 && t.seq_len >= 1) {
    const int chunks = chunk_count(par.cp, par.layout);
    if (t.seq_len % chunks != 0) {
      p.add(prefix, "train.seq_len (", t.seq_len, ") is not a multiple of ",
            par.layout != ShardLayout::contiguous ? "2 * parallel.cp = " : "parallel.cp = ", chunks,
            ", which the ", layout_name(par.layout), " layout needs");
    }
  }
  if (config.data.source == DataSource::retrieval) {
    const RetrievalConfig& r = config.data.retrieval;
    const RetrievalSpec spec{config.model.vocab_size, t.seq_len, r.pairs, r.key_tokens,
                             r.value_tokens, r.queries, t.seed};
    for (const std::string& line : check_retrieval_spec(spec)) p.add(prefix, line);
  }
}

}  // namespace

std::int64_t mlp_chunk_tokens(std::int64_t key, bool recompute, std::int64_t local_tokens) {
  const std::int64_t chunk = key > 0 ? key : recompute ? kMlpAutoChunkTokens : local_tokens;
  return std::max<std::int64_t>(1, std::min(chunk, local_tokens));
}

std::vector<StageConfig> run_stages(const TrainingConfig& train) {
  if (!train.stages.empty()) return train.stages;
  return {StageConfig{train.steps, train.seq_len, train.batch_size}};
}

TrainConfig stage_config(const TrainConfig& config, int index) {
  TrainConfig stage = config;
  const std::vector<StageConfig> stages = run_stages(config.train);
  const StageConfig& chosen = stages.at(static_cast<std::size_t>(index));
  stage.train.seq_len = chosen.seq_len;
  stage.train.batch_size = chosen.batch_size.value_or(config.train.batch_size);
  return stage;
}

int stage_of_step(const TrainingConfig& train, int step) {
  const std::vector<StageConfig> stages = run_stages(train);
  int end = 0;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    end += stages[i].steps;
    if (step < end) return static_cast<int>(i);
  }
  return static_cast<int>(stages.size()) - 1;
}

void validate(const TrainConfig& config, int world_size) {
  Problems p;
  const ModelConfig& m = config.model;
  p.at_least("model.vocab_size", m.vocab_size, 2);
  p.at_least("model.d_model", m.d_model, 1);
  p.at_least("model.n_layers", m.n_layers, 1);
  p.at_least("model.n_heads", m.n_heads, 1);
  p.at_least("model.n_kv_heads", m.n_kv_heads, 1);
  if (m.n_heads >= 1 && m.n_kv_heads >= 1 && m.n_heads % m.n_kv_heads != 0) {
    p.add("model.n_heads (", m.n_heads, ") is not a multiple of model.n_kv_heads (", m.n_kv_heads,
          "); grouped-query attention shares each K/V head among n_heads / n_kv_heads query heads");
  }
  if (m.head_dim) {
    p.at_least("model.head_dim", *m.head_dim, 1);
  } else if (m.d_model >= 1 && m.n_heads >= 1 && m.d_model % m.n_heads != 0) {
    p.add("model.d_model (", m.d_model, ") is not a multiple of model.n_heads (", m.n_heads,
          "); set model.head_dim or choose n_heads dividing d_model");
  }
  // No evenness: RoPE rotates q and k alone.
  if (m.v_head_dim) p.at_least("model.v_head_dim", *m.v_head_dim, 1);
  if (m.n_heads >= 1 && m.resolved_head_dim() >= 1 && m.resolved_head_dim() % 2 != 0) {
    p.add("the head dimension ", m.resolved_head_dim(),
          m.head_dim ? " (model.head_dim)" : " (model.d_model / model.n_heads)",
          " is odd; RoPE rotates pairs of dimensions, so it must be even");
  }
  p.at_least("model.ffn_hidden", m.ffn_hidden, 1);
  p.positive("model.rope_theta", m.rope_theta);
  p.positive("model.norm_eps", m.norm_eps);
  p.positive("model.init_std", m.init_std);
  if (m.attention_window < 0) {
    p.add("model.attention_window is ", m.attention_window,
          "; expected 0 (no window) or the number of tokens a query sees, itself included");
  }

  const TrainingConfig& t = config.train;
  if (t.stages.empty()) p.at_least("train.seq_len", t.seq_len, 1);
  p.at_least("train.batch_size", t.batch_size, 1);
  p.at_least("train.grad_accum", t.grad_accum, 1);
  p.at_least("train.steps", t.steps, 1);
  p.positive("train.lr", t.lr);
  if (!(t.min_lr >= 0.0 && t.min_lr <= t.lr)) {
    p.add("train.min_lr is ", format_value(t.min_lr), "; expected 0 <= min_lr <= train.lr (",
          format_value(t.lr), ")");
  }
  p.at_least("train.warmup_steps", t.warmup_steps, 0);
  if (t.warmup_steps > t.steps) {
    p.add("train.warmup_steps (", t.warmup_steps, ") is more than train.steps (", t.steps, ")");
  }
  p.at_least("train.weight_decay", t.weight_decay, 0.0);
  p.unit_interval("train.beta1", t.beta1);
  p.unit_interval("train.beta2", t.beta2);
  p.positive("train.adam_eps", t.adam_eps);
  p.at_least("train.grad_clip", t.grad_clip, 0.0);
  if (t.recompute_attention && !t.recompute) {
    p.add(
        "train.recompute_attention is true but train.recompute is false; the attention is "
        "recomputed only as part of recomputation: set train.recompute to true or "
        "train.recompute_attention to false");
  }
  p.at_least("train.loss_chunk_tokens", t.loss_chunk_tokens, 1);
  p.at_least("train.mlp_chunk_tokens", t.mlp_chunk_tokens, 0);
  p.at_least("train.log_every", t.log_every, 1);
  p.at_least("train.eval_every", t.eval_every, 0);
  p.at_least("train.eval_batches", t.eval_batches, 1);
  p.at_least("train.checkpoint_every", t.checkpoint_every, 0);
  p.at_least("train.keep_checkpoints", t.keep_checkpoints, 1);

  const ParallelConfig& par = config.parallel;
  p.at_least("parallel.dp", par.dp, 1);
  p.at_least("parallel.cp", par.cp, 1);
  if (par.dp >= 1 && par.cp >= 1 && std::int64_t{par.dp} * par.cp != world_size) {
    p.add("parallel.dp x parallel.cp = ", par.dp, " x ", par.cp, " = ",
          std::int64_t{par.dp} * par.cp, " ranks, but the job has ", world_size,
          "; choose dp and cp with dp * cp = ", world_size);
  }
  if (t.stages.empty()) {
    add_sequence_problems(config, "", p);
  } else {
    std::int64_t steps = 0;
    for (std::size_t i = 0; i < t.stages.size(); ++i) {
      const StageConfig& stage = t.stages[i];
      const std::string key = "train.stages[" + std::to_string(i) + "]";
      p.at_least(key + ".steps", stage.steps, 1);
      p.at_least(key + ".seq_len", stage.seq_len, 1);
      if (stage.batch_size) p.at_least(key + ".batch_size", *stage.batch_size, 1);
      steps += stage.steps;
      if (stage.seq_len >= 1 && stage.batch_size.value_or(1) >= 1) {
        add_sequence_problems(stage_config(config, static_cast<int>(i)),
                              key + " (seq_len " + std::to_string(stage.seq_len) + "): ", p);
      }
    }
    if (steps != t.steps) {
      p.add("train.stages add up to ", steps, " steps but train.steps is ", t.steps,
            "; set train.steps to ", steps, " (or leave it out where the stages are given)");
    }
  }

  const DataConfig& d = config.data;
  if (d.source == DataSource::retrieval && d.documents.value_or(false)) {
    p.add("data.documents is true but data.source is retrieval, whose samples are one document "
          "each; set data.source to hdf5 or leave data.documents out");
  }
  if (m.rope_document_positions.value_or(false)) {
    if (d.source == DataSource::retrieval) {
      p.add("model.rope_document_positions is true but data.source is retrieval, which has no "
            "documents; leave it out or set it to false");
    } else if (!d.documents.value_or(true)) {
      p.add("model.rope_document_positions is true but data.documents is false; RoPE positions "
            "restart at documents only where the sequences carry them");
    }
  }
  if (d.source == DataSource::hdf5) {
    if (d.train_path.empty()) p.add("data.train_path is empty; data.source hdf5 needs a dataset");
    if (t.eval_every > 0 && d.val_path.empty()) {
      p.add("data.val_path is empty; evaluation (train.eval_every = ", t.eval_every,
            ") needs a validation dataset; set it or set train.eval_every to 0");
    }
  }

  if (config.run.dir.empty()) p.add("run.dir is empty; expected the run's directory");
  if (config.run.backend == Backend::cuda) add_cuda_problems(config, p);
  p.throw_if_any();
}

TrainConfig default_gpu_config(int gpus) {
  TrainConfig c;
  c.model.vocab_size = 256;
  c.model.d_model = 256;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 4;
  c.model.ffn_hidden = 704;
  c.model.rope_theta = 100000;
  c.train.batch_size = 16;
  // The lookup is learned at 256 tokens in a few seconds, then kept while the context grows to
  // 16k, where the pair lies anywhere in 16k tokens (on several GPUs, often in another rank's
  // shard).
  c.train.stages = {StageConfig{400, 256, std::nullopt}, StageConfig{200, 16384, std::nullopt}};
  c.train.steps = 600;
  c.train.seq_len = 16384;
  c.train.lr = 1e-3;
  c.train.min_lr = 1e-4;
  c.train.warmup_steps = 20;
  c.train.weight_decay = 0.0;
  c.train.log_every = 20;
  c.train.eval_every = 100;
  c.train.eval_batches = 16;
  c.parallel.cp = std::max(1, gpus);
  c.data.retrieval.pairs = 1;
  c.data.retrieval.queries = 1;
  c.run.dir = "runs/default-gpu";
  c.run.backend = Backend::cuda;
  return c;
}

void validate_for_cuda(const TrainConfig& config) {
  Problems p;
  add_cuda_problems(config, p);
  p.throw_if_any();
}

}  // namespace ringattn::train
