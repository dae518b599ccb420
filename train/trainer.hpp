// The training loop, on the CPU (fp32) or CUDA (bf16) backend: one Trainer per job, every rank of `world` runs it.
//
// world = dp x cp (config.parallel): rank r is context-parallel rank r % cp of data-parallel
// replica r / cp; each replica's cp ranks form a ring (split_communicator) over which the model
// shards every sequence. One optimizer step:
//   1. the step's samples: grad_accum micro-batches of batch_size sequences per dp replica, sample
//      n = ((step * grad_accum + micro) * dp + dp_rank) * batch_size + b (retrieval: the task's
//      training sample n; hdf5: the sampler's sequence at data position n), each rank taking its
//      own shard of every sequence;
//   2. the loss normaliser W = the loss-mask sum over every rank and micro-batch of the step
//      (all-reduced over the world before the forward), each micro-batch adding the gradient of
//      (its weighted loss sum) / W;
//   3. the gradients summed over the whole world: every rank holds the same parameters (the cp
//      ranks saw different tokens of the same sequences, the dp replicas different sequences);
//      after that every rank holds the whole gradient, so the global norm is its local norm;
//   4. clip to train.grad_clip, AdamW (fp32 master weights = the parameters) at the step's
//      learning rate (linear warmup over warmup_steps, then cosine decay to min_lr).
// run.resume ("latest" or a path; train/checkpoint.hpp) restores the parameters, the AdamW
// moments and the step from a checkpoint written under any dp x cp layout; the data of a step is
// a pure function of the step, so a resumed run continues with the same samples.
// The loss reported is the step's weighted mean over all its tokens. A non-finite loss or
// gradient norm throws ringattn::Error naming the step (on every rank alike).
// train.profile times every step's ops by phase (TrainModel's profile, train/model.hpp); at the
// end of run() rank 0 logs a table of the phases, slowest first (calls, total ms, ms per step,
// share of the steps' wall time, and the wall time no phase holds), and writes it as JSON to
// <run.dir>/profile.json when it writes metrics.
#pragma once

#include <atomic>
#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "train/config.hpp"

namespace ringattn::train {

struct StepMetrics {
  int step = 0;  // 1-based
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping
  double tokens_per_s = 0.0;
  // model FLOPs (model_flops_per_token) per second over the peak of the GPUs in use; 0 on the
  // CPU or a GPU whose peak is unknown
  double mfu = 0.0;
  double seconds = 0.0;
  // when the step ended: seconds since the Unix epoch (the wall clock, as other programs' logs and
  // samplers such as nvidia-smi's time their lines)
  double unix_time = 0.0;
  // the most memory in use so far: this GPU's device memory (cuda), else the process's resident
  // memory (cpu)
  double peak_memory_mib = 0.0;
};

struct EvalMetrics {
  int step = 0;
  double loss = 0.0;
  double accuracy = -1.0;  // retrieval accuracy on held-out samples; -1 for hdf5 data
};

struct TrainerOptions {
  std::ostream* log = nullptr;  // rank 0's log lines (nullptr: silent)
  bool write_metrics = true;    // rank 0 appends to <run.dir>/metrics.jsonl
  // rank 0 writes <run.dir>/ckpt-<step>.h5 every train.checkpoint_every steps and at the end of
  // run() (train/checkpoint.hpp; the newest train.keep_checkpoints kept)
  bool write_checkpoints = true;
  // A stop signal (main() sets it from SIGINT/SIGTERM). When given, run() measures a checkpoint
  // write before step 1 and prints it beside kill_timeout_s, and polls the flag at every block
  // boundary of a step and after every step (all ranks agree through an all-reduce). When set on
  // any rank, the step in flight is abandoned at the next block boundary (its parameters and
  // moments untouched: those of the last completed step), run() writes a checkpoint of the last
  // completed step (if write_checkpoints, and where it can be written before kill_timeout_s
  // passes) and returns early.
  const volatile std::sig_atomic_t* stop_requested = nullptr;
  // steady_clock nanoseconds at the first signal (0 before), set by the signal handler.
  const std::atomic<std::int64_t>* stop_time_ns = nullptr;
  // Seconds between the stop signal and a SIGKILL of the launcher (OpenMPI's
  // odls_base_sigkill_timeout); 0: none known.
  double kill_timeout_s = 0.0;
  // Where kill_timeout_s comes from, for messages ("mpiexec's odls_base_sigkill_timeout").
  std::string kill_timeout_source;
};

// The learning rate of optimizer step `step` (0-based).
double learning_rate(const TrainingConfig& train, int step);

class Trainer {
 public:
  // Checks that every rank of `world` was given the same config (every key but the dataset paths;
  // a difference throws CollectiveError on every rank naming the keys and the ranks' values),
  // validates it for world's size (naming the key) and sets up the mesh, the model (initialised
  // from train.seed) and the data. Collective over `world`: an error of any kind on one rank
  // (a file it cannot write, memory it cannot get) fails every rank alike (CollectiveError).
  Trainer(const TrainConfig& config, std::shared_ptr<Communicator> world,
          TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step (collective).
  StepMetrics step();
  // Held-out loss (and retrieval accuracy) over train.eval_batches batches (collective).
  EvalMetrics evaluate();
  // train.steps steps with logging and evaluation; the metrics of every step.
  std::vector<StepMetrics> run();

  // Writes the checkpoint of the steps done so far (rank 0 writes; collective: all ranks wait).
  void save_checkpoint();

  int steps_done() const;
  std::int64_t parameter_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ringattn::train
