#include "parallel/host_threads.hpp"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <utility>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"

namespace ringattn {

int rank_threads(int allowed_cpus, int online_cpus, int node_ranks) {
  constexpr const char* kWhere = "rank_threads";
  const std::pair<const char*, int> counts[] = {
      {"allowed_cpus", allowed_cpus}, {"online_cpus", online_cpus}, {"node_ranks", node_ranks}};
  for (const auto& [name, value] : counts) {
    if (value < 1) ringattn::detail::fail(kWhere, name, " is ", value, "; expected >= 1");
  }
  return std::max(1, std::min(allowed_cpus, online_cpus / node_ranks));
}

void use_rank_threads(const MpiCommunicator& comm) {
  const int node_ranks = node_local_size(comm);  // collective: every rank calls it
  if (const char* set = std::getenv("RINGATTN_NUM_THREADS"); set != nullptr && *set != '\0') return;
  const int online = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // Without the variable, the pool's default is the CPUs of this process's affinity mask.
  cpu::set_num_threads(rank_threads(cpu::num_threads(), online, node_ranks));
}

}  // namespace ringattn
