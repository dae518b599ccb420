#include "train/host_threads.hpp"

#include <algorithm>
#include <utility>

#include "ringattn/error.hpp"

namespace ringattn::train {

int rank_threads(int allowed_cpus, int online_cpus, int node_ranks) {
  constexpr const char* kWhere = "train::rank_threads";
  const std::pair<const char*, int> counts[] = {
      {"allowed_cpus", allowed_cpus}, {"online_cpus", online_cpus}, {"node_ranks", node_ranks}};
  for (const auto& [name, value] : counts) {
    if (value < 1) ringattn::detail::fail(kWhere, name, " is ", value, "; expected >= 1");
  }
  return std::max(1, std::min(allowed_cpus, online_cpus / node_ranks));
}

}  // namespace ringattn::train
