// The collective checks of every ring call: they gather small texts from all ranks, so that each
// rank reaches the same verdict and throws the same message. No rank may throw before the others
// have gathered, or they would wait for it forever.
#include "parallel/communicator.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>

#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {
namespace {

// "rank 3", "ranks 0, 2, 5", "ranks 1-7": runs of three or more ranks become ranges.
std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t end = i + 1;
    while (end < ranks.size() && ranks[end] == ranks[end - 1] + 1) ++end;
    if (i > 0) text += ", ";
    if (end - i >= 3) {
      text += std::to_string(ranks[i]) + "-" + std::to_string(ranks[end - 1]);
    } else {
      text += std::to_string(ranks[i]);
      if (end - i == 2) text += ", " + std::to_string(ranks[i + 1]);
    }
    i = end;
  }
  return text;
}

std::vector<std::string> split_items(const std::string& description) {
  std::vector<std::string> items;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = description.find("; ", begin);
    items.push_back(description.substr(begin, end - begin));
    if (end == std::string::npos) return items;
    begin = end + 2;
  }
}

// The ranks holding each distinct value, in order of their lowest rank.
std::vector<std::pair<std::string, std::vector<int>>> group_by_value(
    const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(values.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& group) { return group.first == values[r]; });
    if (it == groups.end()) {
      groups.push_back({values[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  return groups;
}

std::string holds(const std::pair<std::string, std::vector<int>>& group) {
  return rank_list(group.second) + (group.second.size() == 1 ? " has " : " have ") + group.first;
}

// With a largest group: "rank 1 has X but ranks 0, 2, 3 have Y" for each other value. Without one
// (two ranks, or a tie): "rank 0 has X but rank 1 has Y, ...", in rank order.
void describe_disagreement(const std::vector<std::string>& values, std::string& message) {
  const auto groups = group_by_value(values);
  std::size_t largest = 0;
  bool unique = true;
  for (std::size_t g = 1; g < groups.size(); ++g) {
    if (groups[g].second.size() > groups[largest].second.size()) {
      largest = g;
      unique = true;
    } else if (groups[g].second.size() == groups[largest].second.size()) {
      unique = false;
    }
  }
  if (!message.empty()) message += "; ";
  if (!unique) {
    message += holds(groups[0]) + " but ";
    for (std::size_t g = 1; g < groups.size(); ++g)
      message += (g > 1 ? ", " : "") + holds(groups[g]);
    return;
  }
  bool first = true;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g == largest) continue;
    message += (first ? "" : "; ") + holds(groups[g]) + " but " + holds(groups[largest]);
    first = false;
  }
}

}  // namespace

void host_all_reduce_sum(const Communicator& comm, double* values, std::size_t count) {
  if (count == 0) return;
  const std::size_t ranks = static_cast<std::size_t>(comm.size());
  std::vector<double> all(ranks * count);
  comm.host_all_gather(values, count * sizeof(double), all.data());
  for (std::size_t i = 0; i < count; ++i) {
    double sum = 0.0;
    for (std::size_t r = 0; r < ranks; ++r) sum += all[r * count + i];
    values[i] = sum;
  }
}

std::vector<std::string> all_gather_text(const Communicator& comm, std::string_view text) {
  const int ranks = comm.size();
  const std::uint64_t length = text.size();
  std::vector<std::uint64_t> lengths(static_cast<std::size_t>(ranks));
  comm.host_all_gather(&length, sizeof(length), lengths.data());
  const std::uint64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<char> padded(longest, '\0');
  std::memcpy(padded.data(), text.data(), text.size());
  std::vector<char> all(longest * static_cast<std::size_t>(ranks));
  comm.host_all_gather(padded.data(), longest, all.data());
  std::vector<std::string> texts(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) texts[r].assign(all.data() + r * longest, lengths[r]);
  return texts;
}

void check_same_on_all_ranks(const Communicator& comm, const char* where,
                             const std::string& description) {
  const std::vector<std::string> all = all_gather_text(comm, description);
  if (std::all_of(all.begin(), all.end(), [&](const std::string& d) { return d == all[0]; })) {
    return;
  }
  std::vector<std::vector<std::string>> items;
  for (const std::string& d : all) items.push_back(split_items(d));
  const bool same_items = std::all_of(
      items.begin(), items.end(), [&](const auto& list) { return list.size() == items[0].size(); });
  std::string message;
  if (same_items) {
    for (std::size_t i = 0; i < items[0].size(); ++i) {
      std::vector<std::string> values;
      for (const auto& list : items) values.push_back(list[i]);
      if (std::all_of(values.begin(), values.end(),
                      [&](const std::string& v) { return v == values[0]; })) {
        continue;
      }
      describe_disagreement(values, message);
    }
  } else {
    describe_disagreement(all, message);
  }
  throw CollectiveError(where, "the ranks disagree: " + message, ErrorKind::invalid_argument,
                        comm.size());
}

void check_no_rank_failed(const Communicator& comm, const char* where, const Error* local_error) {
  // The kind travels as the first character, the message (without our own `where: `) after it.
  std::string text;
  if (local_error != nullptr) {
    std::string message = local_error->what();
    const std::string prefix = std::string(where) + ": ";
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    text = std::to_string(static_cast<int>(local_error->kind())) + message;
  }
  const std::vector<std::string> all = all_gather_text(comm, text);
  std::vector<std::string> messages;
  std::vector<int> failed;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].empty()) continue;
    failed.push_back(r);
    messages.push_back(all[r].substr(1));
  }
  if (failed.empty()) return;
  const auto kind = static_cast<ErrorKind>(all[failed.front()][0] - '0');
  if (static_cast<int>(failed.size()) == comm.size() &&
      std::all_of(messages.begin(), messages.end(),
                  [&](const std::string& m) { return m == messages[0]; })) {
    throw CollectiveError(where, messages[0] + (comm.size() > 1 ? " (on every rank)" : ""), kind,
                          comm.size());
  }
  // Ranks with the same message are named together, in order of their lowest rank.
  std::map<int, std::pair<std::vector<int>, std::string>> by_first_rank;
  for (std::size_t i = 0; i < failed.size(); ++i) {
    auto it = std::find_if(by_first_rank.begin(), by_first_rank.end(),
                           [&](const auto& entry) { return entry.second.second == messages[i]; });
    if (it == by_first_rank.end()) {
      by_first_rank[failed[i]] = {{failed[i]}, messages[i]};
    } else {
      it->second.first.push_back(failed[i]);
    }
  }
  std::string message;
  for (const auto& [first, group] : by_first_rank) {
    message += (message.empty() ? "" : "; ") + rank_list(group.first) + ": " + group.second;
  }
  throw CollectiveError(where, message, kind, comm.size());
}

int communicator_rank(const Communicator& comm) {
  return comm.rank();
}
int communicator_size(const Communicator& comm) {
  return comm.size();
}

std::shared_ptr<Communicator> split_communicator(const Communicator& comm, int color, int key) {
  return comm.split(color, key);
}

}  // namespace ringattn
