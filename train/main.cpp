// ringattn-train [CONFIG.yaml] [--set key=value ...]
//
// Trains the decoder-only transformer with ring attention over the context-parallel ranks, under
// mpirun (or alone as one rank), on GPUs (bf16, one per rank, by node-local rank) or CPU ranks
// (fp32). Without a config file it runs the embedded default: on a machine with a GPU passkey
// retrieval over all ranks' GPUs, 256 tokens and then 16k (default_gpu_config, cp = the world
// size: mpirun -np <GPUs> ringattn-train), elsewhere tiny-cpu (TrainConfig{}, equal to
// configs/tiny-cpu.yaml: mpirun -np 2 ringattn-train). The run ends with a summary and writes
// metrics.png beside metrics.jsonl.
// The ranks first agree that they all run ringattn-train, that their command lines parse and on
// what they were asked (training, --print-config, --help): a command line that does not parse is
// said once and exits with CLI11's status. Errors (a bad config, a missing dataset, a non-finite
// loss) that every rank meets alike print one line on rank 0 and exit with status 1 on every rank;
// an error of one rank alone prints on that rank, prefixed by it, and ends the job with MPI_Abort
// (the others may wait for it).
// SIGINT/SIGTERM stop the run at the next block boundary of the step in flight, on all ranks (they
// agree at every boundary), and write a checkpoint of the last completed step where it can be
// written before the launcher's SIGKILL, then exit with status 128 + the signal's number (143 for
// SIGTERM) when steps were left; a second signal exits at once. Under mpiexec the ranks get
// SIGTERM odls_base_sigkill_timeout seconds after mpiexec does, and SIGKILL as many seconds later:
// launch with --mca odls_base_sigkill_timeout N (tools/main.sh does), N above the checkpoint write
// time the trainer prints before step 1.
#include <mpi.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <time.h>
#include <unistd.h>

#include "parallel/communicator.hpp"
#include "parallel/host_threads.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/runtime.hpp"
#include "tools/cli_checks.hpp"
#include "tools/mpi_session.hpp"
#include "train/config.hpp"
#include "train/trainer.hpp"

namespace {

namespace tools = ringattn::tools;

volatile std::sig_atomic_t g_stop = 0;
std::atomic<std::int64_t> g_stop_time_ns{0};
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "the signal handler stores a time");

// The first SIGINT/SIGTERM asks the trainer to stop (at the next block boundary, with a final
// checkpoint); a second one ends this process at once.
extern "C" void request_stop(int signal_number) {
  if (g_stop != 0) {
    constexpr char kMessage[] = "ringattn-train: a second stop signal: exiting now\n";
    [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
    _exit(128 + signal_number);
  }
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  g_stop_time_ns.store(static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec);
  g_stop = signal_number;
}

// Seconds between OpenMPI's forwarding of SIGTERM to the ranks and its SIGKILL: its MCA parameter
// odls_base_sigkill_timeout (1 s unless set), which reaches each rank's environment.
std::pair<double, std::string> launcher_kill_timeout() {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return {0.0, ""};
  const char* text = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  if (text == nullptr) return {1.0, "OpenMPI's default odls_base_sigkill_timeout"};
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || !(seconds > 0.0)) return {1.0, "OpenMPI's default odls_base_sigkill_timeout"};
  return {seconds, "mpiexec's odls_base_sigkill_timeout"};
}

// "ringattn-train: x" -> "x": messages of the collective checks in main() already name the program.
const char* without_program(const char* message) {
  constexpr std::string_view kPrefix = "ringattn-train: ";
  return std::string_view(message).starts_with(kPrefix) ? message + kPrefix.size() : message;
}

// An error of this rank alone (a file only it reads, memory only it ran out of, a peer of its ring):
// the others may be waiting for it in a collective, so it says what happened, prefixed by its rank,
// and takes the job down with it.
[[noreturn]] void fail_alone(int rank, int world_size, const std::exception& e) {
  if (world_size == 1) {
    std::fprintf(stderr, "ringattn-train: error: %s\n", without_program(e.what()));
    MPI_Finalize();
    std::exit(1);
  }
  std::fprintf(stderr, "ringattn-train: error on rank %d of %d: %s (stopping every rank)\n", rank,
               world_size, without_program(e.what()));
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// Collective, the job's first exchange: -1 when every rank runs this program, its command line
// parsed and every rank asks for the same (training, --print-config or --help); else this rank's
// exit status, once one rank has said why:
//   - ranks that run another program (an MPMD launch): 1, the lowest rank of this program naming
//     them and their programs (the exchange is the one every ringattn tool opens with,
//     tools::gather_command_lines, so each of their ranks names the programs too);
//   - command lines that did not parse: CLI11's status of the lowest rank whose line did not,
//     rank 0 saying their errors once ("(on every rank)" where every rank's is the same);
//   - --help on every rank: 0, rank 0 printing the help.
// Ranks that ask for different things (--print-config given to some only) throw CollectiveError.
int agree_on_command_line(const ringattn::Communicator& world, const tools::CommandLine& line,
                          bool print_config) {
  const std::vector<std::vector<std::string>> lines = tools::gather_command_lines(world, line.args);
  const std::string& program = lines[world.rank()].front();
  std::string others;
  int first_here = -1;
  for (int r = 0; r < world.size(); ++r) {
    if (lines[r].front() != program) {
      others +=
          ringattn::detail::concat(others.empty() ? "" : "; ", "rank ", r, ": the program is '",
                                   lines[r].front(), "', not '", program, "'");
    } else if (first_here < 0) {
      first_here = r;
    }
  }
  if (!others.empty()) {
    if (world.rank() == first_here) {
      std::fprintf(stderr, "ringattn-train: error: %s; start every rank with %s\n", others.c_str(),
                   program.c_str());
    }
    return 1;
  }

  std::optional<ringattn::Error> parse_error;
  if (line.exit_code > 0) parse_error.emplace("ringattn-train", line.text);
  const int status = parse_error ? line.cli11_exit_code : 0;
  std::vector<int> statuses(static_cast<std::size_t>(world.size()));
  world.host_all_gather(&status, sizeof status, statuses.data());
  try {
    ringattn::check_no_rank_failed(world, "ringattn-train", parse_error ? &*parse_error : nullptr);
  } catch (const ringattn::CollectiveError& e) {
    if (world.rank() == 0) {
      std::fprintf(stderr, "ringattn-train: error: %s\nRun with --help for more information.\n",
                   without_program(e.what()));
    }
    return *std::find_if(statuses.begin(), statuses.end(), [](int s) { return s != 0; });
  }

  const bool help = line.exit_code == 0;
  ringattn::check_same_on_all_ranks(
      world, "ringattn-train",
      ringattn::detail::concat(help ? "" : "no ", "--help; ", print_config ? "" : "no ",
                               "--print-config"));
  if (!help) return -1;
  if (world.rank() == 0) std::fputs(line.text.c_str(), stdout);
  return 0;
}

// Each rank reads its own config; a rank that cannot (a file only it lacks, a bad --set of an
// MPMD launch) fails every rank, and a config that fails everywhere is said once. Then prints it
// (--print-config) or trains; returns the exit status.
int run(const std::shared_ptr<ringattn::Communicator>& world, const std::string& config_path,
        const std::vector<std::string>& overrides, bool print_config) {
  ringattn::train::TrainConfig config;
  std::optional<ringattn::Error> failure;
  try {
    const bool gpus = ringattn::built_with_cuda() && ringattn::cuda_device_count() > 0;
    config = !config_path.empty() ? ringattn::train::load_config_file(config_path)
             : gpus               ? ringattn::train::default_gpu_config(world->size())
                                  : ringattn::train::TrainConfig{};
    ringattn::train::apply_overrides(config, overrides);
  } catch (const ringattn::Error& e) {
    failure = e;
  }
  ringattn::check_no_rank_failed(*world, "ringattn-train", failure ? &*failure : nullptr);
  if (print_config) {
    if (world->rank() == 0) std::cout << ringattn::train::dump_config(config);
    return 0;
  }
  // The CPU backend's threads: at most this rank's part of its node (parallel/host_threads.hpp).
  ringattn::use_rank_threads(dynamic_cast<const ringattn::MpiCommunicator&>(*world));
  ringattn::train::TrainerOptions options;
  options.log = &std::cout;
  options.stop_requested = &g_stop;
  options.stop_time_ns = &g_stop_time_ns;
  std::tie(options.kill_timeout_s, options.kill_timeout_source) = launcher_kill_timeout();
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  ringattn::train::Trainer trainer(config, world, options);
  trainer.run();
  // Stopped by a signal before the last step: the shell's status of that signal, so that a job
  // script does not take the run for finished.
  return g_stop != 0 && trainer.steps_done() < config.train.steps ? 128 + g_stop : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ringattn-train: train a small transformer with ring attention (GPU or CPU ranks)"};
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_config = false;
  app.add_option("config", config_path,
                 "YAML config (default: an embedded one; retrieval at 16k on GPUs, else tiny-cpu)");
  app.add_option("--set", overrides, "override a config key: --set train.steps=20")
      ->type_name("KEY=VALUE");
  app.add_flag("--print-config", print_config, "print the resolved config and exit");
  // Parsed before MPI starts, answered once the ranks agree on it (agree_on_command_line).
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);

  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    std::shared_ptr<ringattn::Communicator> world = ringattn::mpi_world_communicator();
    status = agree_on_command_line(*world, line, print_config);
    if (status < 0) status = run(world, config_path, overrides, print_config);
  } catch (const ringattn::CollectiveError& e) {
    // Every rank of the world threw it alike: one rank says it, and all end normally.
    int world_size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (e.ranks() != world_size) fail_alone(rank, world_size, e);
    if (rank == 0) std::fprintf(stderr, "ringattn-train: error: %s\n", without_program(e.what()));
    status = 1;
  } catch (const std::exception& e) {
    int world_size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    fail_alone(rank, world_size, e);
    status = 1;
  }
  MPI_Finalize();
  return status;
}
