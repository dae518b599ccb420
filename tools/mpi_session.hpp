// MpiSession: how the tools that run on every rank of mpirun (ringattn-gradcheck, ringattn-bench
// ring) start and stop, so that no error leaves a rank waiting for another:
//
//   CommandLine line = parse_command_line(app, argc, argv);  // before MPI: --help works anywhere
//   MpiSession session("ringattn-gradcheck");                // MPI_Init ... MPI_Finalize
//   if (const int code = session.agree_on(line); code >= 0) return code;
//   ... options checked alike on every rank: session.report(problem) and return 2 ...
//   if (!session.no_rank_failed(checks of this rank alone)) return 2;
//   ... the work; an error of one rank: session.fail_alone(message) ...
//
// Every message goes to stderr on each rank that prints it, as "rank R: TOOL: MESSAGE" when the
// world has more than one rank.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/error.hpp"
#include "tools/cli_checks.hpp"

namespace ringattn::tools {

namespace detail {

inline std::string program_name(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

inline std::vector<std::string> split_at_nul(const std::string& joined) {
  std::vector<std::string> args;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = joined.find('\0', begin);
    args.push_back(joined.substr(begin, end - begin));
    if (end == std::string::npos) return args;
    begin = end + 1;
  }
}

}  // namespace detail

// Collective: every rank's command line in rank order, each argv with argv[0] cut to the program's
// name. The first exchange of every ringattn program under mpirun (the tools' agree_on and
// ringattn-train alike), so that the ranks of an MPMD launch that mixes programs meet in the same
// exchange and each names the programs, instead of taking another program's bytes for its own.
inline std::vector<std::vector<std::string>> gather_command_lines(
    const Communicator& world, const std::vector<std::string>& args) {
  std::string joined = detail::program_name(args.empty() ? std::string() : args[0]);
  for (std::size_t i = 1; i < args.size(); ++i) joined += '\0' + args[i];
  std::vector<std::vector<std::string>> lines;
  for (const std::string& text : all_gather_text(world, joined)) {
    lines.push_back(detail::split_at_nul(text));
  }
  return lines;
}

class MpiSession {
 public:
  explicit MpiSession(std::string tool) : tool_(std::move(tool)) {
    MPI_Init(nullptr, nullptr);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    world_ = MpiCommunicator::world();
  }
  ~MpiSession() {
    world_.reset();
    MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // `message` on stderr as this rank's.
  void report(const std::string& message) const {
    if (size_ > 1) {
      std::fprintf(stderr, "rank %d: %s: %s\n", rank_, tool_.c_str(), message.c_str());
    } else {
      std::fprintf(stderr, "%s: %s\n", tool_.c_str(), message.c_str());
    }
    std::fflush(stderr);
  }

  // Collective: -1 when every rank got the same arguments and they parsed; else the exit status,
  // the same on every rank, with what it printed: a rank whose arguments did not parse prints its
  // error; ranks started with different arguments (an MPMD launch) all print the first argument
  // that differs and its values on two ranks; help is printed once, by rank 0.
  int agree_on(const CommandLine& line) const {
    const std::vector<std::vector<std::string>> all = gather_command_lines(*world_, line.args);
    for (int r = 1; r < size_; ++r) {
      if (all[r] == all[0]) continue;
      if (line.exit_code > 0) report(line.text);
      report(first_difference(all[0], all[r], r));
      return 2;
    }
    // The same arguments everywhere parse alike everywhere.
    if (line.exit_code == 0 && rank_ == 0) std::fputs(line.text.c_str(), stdout);
    if (line.exit_code > 0) report(line.text + " (run with --help for more information)");
    return line.exit_code;
  }

  // Collective: true when no rank has a `local_error` (a check of this rank alone: a file only it
  // writes, its memory); else false on every rank, each having printed its own error or which
  // rank cannot start and why.
  bool no_rank_failed(const std::string& local_error) const {
    const std::vector<std::string> all = all_gather_text(*world_, local_error);
    for (int r = 0; r < size_; ++r) {
      if (all[r].empty()) continue;
      report(!local_error.empty()
                 ? local_error
                 : ringattn::detail::concat("stopping: rank ", r, " cannot start: ", all[r]));
      return false;
    }
    return true;
  }

  // An error of this rank alone, which the other ranks may be waiting for: reports it and, when
  // there are other ranks, ends the whole job (MPI_Abort). Returns only when this rank is alone.
  void fail_alone(const std::string& message) const {
    report(message);
    if (size_ > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  static bool is_option(const std::string& arg) {
    return arg.size() > 1 && arg[0] == '-' && !(arg[1] >= '0' && arg[1] <= '9') && arg[1] != '.';
  }

  // "argument 2 (--time) is '1' on rank 0 but '2' on rank 1": the first argument where rank
  // `other`'s list differs from rank 0's, with the option it is the value of.
  static std::string first_difference(const std::vector<std::string>& first,
                                      const std::vector<std::string>& mine, int other) {
    std::size_t i = 0;
    while (i < first.size() && i < mine.size() && first[i] == mine[i]) ++i;
    auto value = [i](const std::vector<std::string>& args) {
      return i < args.size() ? "'" + args[i] + "'" : std::string("absent");
    };
    std::string name = i == 0 ? "the program" : "argument " + std::to_string(i);
    const std::vector<std::string>& longer = i < first.size() ? first : mine;
    if (i > 0 && !is_option(longer[i]) && is_option(longer[i - 1]))
      name += " (" + longer[i - 1] + ")";
    return ringattn::detail::concat("the ranks got different arguments: ", name, " is ",
                                    value(first), " on rank 0 but ", value(mine), " on rank ",
                                    other, "; start every rank with the same arguments");
  }

  std::string tool_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<MpiCommunicator> world_;
};

}  // namespace ringattn::tools
