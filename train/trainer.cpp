#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <optional>
#include <sstream>
#include <utility>

#include <sys/resource.h>
#include <unistd.h>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "train/checkpoint.hpp"
#include "train/digest.hpp"
#include "train/documents.hpp"
#include "parallel/device_communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/ring_attention.hpp"
#include "ringattn/runtime.hpp"
#include "train/model_cpu.hpp"
#include "train/model_memory.hpp"
#include "train/op_adamw.hpp"
#include "train/plot_png.hpp"
#include "train/retrieval_task.hpp"
#include "train/sequence_sampler.hpp"
#include "train/shard_ranges.hpp"
#include "train/token_dataset.hpp"

namespace ringattn::train {

double learning_rate(const TrainingConfig& t, int step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps) {
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  }
  const int decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  double progress =
      static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps - 1);
  progress = std::min(1.0, std::max(0.0, progress));
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

namespace {

// Thrown at a block boundary of a step when every rank agreed to stop there (not an exception of
// the std::exception kind, so that no handler on the way takes it for an error).
struct StepInterrupted {};

struct MicroBatch {
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> mask;
  std::vector<std::int64_t> documents;  // [batch, document_count]: train/documents.hpp
  std::int64_t document_count = 0;
  std::vector<std::int64_t> positions;  // of this rank's tokens, as the batch's layout gives them
  double weight = 0.0;
  ShardBatch view() const { return {inputs, targets, mask, documents, document_count, positions}; }
};

// A JSON number: 9 significant digits, or `decimals` after the point where one is given (a Unix
// time to the millisecond: 9 digits would keep only tens of seconds); null where not finite.
std::string format_double(double value, int decimals = -1) {
  if (!std::isfinite(value)) return "null";
  char buffer[64];
  if (decimals >= 0) {
    std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.9g", value);
  }
  return buffer;
}

// "1 thread a rank", "8 threads a rank": the CPU backend's pool, for the startup line.
std::string threads_phrase(int threads) {
  return std::to_string(threads) + (threads == 1 ? " thread a rank" : " threads a rank");
}

// Any exception as an Error, for check_no_rank_failed: whatever one rank meets (a filesystem, HDF5
// or YAML error, memory running out) fails every rank alike instead of leaving them waiting.
Error as_error(const char* where, const std::exception& e) {
  if (const auto* error = dynamic_cast<const Error*>(&e)) return *error;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return Error(where, "out of host memory (std::bad_alloc)", ErrorKind::library);
  }
  if (dynamic_cast<const std::filesystem::filesystem_error*>(&e) != nullptr) {
    return Error(where, e.what(), ErrorKind::io);
  }
  return Error(where, e.what(), ErrorKind::library);
}

// run.backend auto: cuda where this ringattn has it and a GPU is visible, else cpu.
Backend resolve_backend(Backend requested) {
  if (requested != Backend::automatic) return requested;
  return built_with_cuda() && cuda_device_count() > 0 ? Backend::cuda : Backend::cpu;
}

}  // namespace

struct Trainer::Impl {
  TrainConfig base;    // the whole run's config (train.stages included)
  TrainConfig config;  // the stage being run: stage_config(base, stage)
  std::vector<StageConfig> stages;  // run_stages(base.train)
  int stage = -1;                   // index into stages; -1 before the first
  TrainerOptions options;
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> cp_comm;
  int world_rank = 0, dp = 1, cp = 1, dp_rank = 0, cp_rank = 0;
  std::vector<TokenRange> ranges;
  Backend backend = Backend::cpu;  // resolved: cpu or cuda
  double flops_per_token = 0.0;    // model_flops_per_token of the config
  double peak_flops = 0.0;         // per GPU, for MFU; 0 when unknown (and on the CPU)
  // The GPU's memory in use before the model was made (the CUDA context, NCCL), for the account.
  double device_in_use_before_model = 0.0;
  bool offload = false;  // train.offload resolved (resolve_offload)
  std::shared_ptr<Communicator> device_world;  // NCCL over the world (cuda)
  std::shared_ptr<Communicator> device_cp;     // NCCL over this rank's ring (cuda)
  SequenceLayoutKind layout = SequenceLayoutKind::zigzag;
  ModelOptions model_options;
  std::unique_ptr<TrainModel> model;
  std::optional<RetrievalTask> task;
  std::optional<TokenDataset> train_data, val_data;
  std::optional<SequenceSampler> sampler;
  // Whether the sequences carry their packed documents (data.documents, resolved against the
  // training dataset by open_data).
  bool documents = false;
  int steps_done = 0;
  // train.profile: the steps profiled so far and their wall time (the phases are the model's).
  // The process's first step pays one-time costs (allocations, GEMM algorithm choices): it is
  // left out of the profile when more steps follow.
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::optional<EvalMetrics> last_eval;       // the newest evaluation of run()
  std::vector<int> stage_of_metrics;          // the stage of each step run() returned
  std::filesystem::path last_checkpoint;      // the newest checkpoint written
  double checkpoint_seconds = 0.0;            // the longest checkpoint write so far
  int profiled_steps = 0;
  double profiled_ms = 0.0;
  int first_step = -1;

  // On a terminal, rank 0 keeps a progress bar on the last line; log lines print above it.
  // Under mpirun a rank's stdout is a pipe or a pseudo-terminal whatever the user's is, so the
  // launcher says: RINGATTN_PROGRESS=1 or 0 (tools/main.sh sets it from its own stdout).
  bool terminal() const {
    if (options.log != &std::cout) return false;
    if (const char* forced = std::getenv("RINGATTN_PROGRESS"); forced != nullptr) {
      return std::string(forced) == "1";
    }
    return std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr && isatty(fileno(stdout)) == 1;
  }

  // Whether any rank has a stop signal (collective).
  bool stop_agreed() const {
    double stop = *options.stop_requested != 0 ? 1.0 : 0.0;
    world->all_reduce_sum(&stop, 1, DType::f64, nullptr);
    return stop > 0.0;
  }

  // Seconds since this rank's stop signal (0 when its time is unknown).
  double seconds_since_stop() const {
    if (options.stop_time_ns == nullptr) return 0.0;
    const std::int64_t at = options.stop_time_ns->load();
    if (at == 0) return 0.0;
    const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now().time_since_epoch())
                                 .count();
    return 1e-9 * static_cast<double>(now - at);
  }

  // The checkpoint of steps_done into `dir` (rank 0 writes it, keeping the newest `keep`), and the
  // seconds it took; collective: a rank that fails makes all fail alike.
  std::pair<std::filesystem::path, double> write_checkpoint(const std::filesystem::path& dir,
                                                            int keep) {
    const auto start = std::chrono::steady_clock::now();
    std::optional<Error> failure;
    std::filesystem::path path;
    std::vector<float> params, m, v;
    // With train.shard_optimizer every rank holds a share of the moments: then it is collective.
    if (world_rank == 0 || config.train.shard_optimizer) model->export_state(params, m, v);
    if (world_rank == 0) try {
        CheckpointState state;
        state.step = steps_done;
        state.data_position.sequences = sequences_before(steps_done);
        state.config_yaml = dump_config(config);
        std::vector<CheckpointTensor> tensors;
        std::size_t offset = 0;
        for (const ParameterInfo& info : model->parameter_infos()) {
          tensors.push_back({info.name, info.shape, params.data() + offset});
          tensors.push_back({"adam_m." + info.name, info.shape, m.data() + offset});
          tensors.push_back({"adam_v." + info.name, info.shape, v.data() + offset});
          offset += static_cast<std::size_t>(info.elements);
        }
        path = train::save_checkpoint(dir, state, tensors, keep);
      } catch (const std::exception& e) {
        failure = as_error("Trainer", e);
      }
    // Every rank waits for the file and fails alike when it could not be written.
    check_no_rank_failed(*world, "Trainer::save_checkpoint", failure ? &*failure : nullptr);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    checkpoint_seconds = std::max(checkpoint_seconds, seconds);
    return {path, seconds};
  }

  // Before step 1 of a run that a signal may stop: writes a checkpoint into a scratch directory
  // of run.dir and deletes it, to know how long one takes (and that run.dir takes one), and says
  // so beside the launcher's kill timeout.
  void measure_checkpoint_write() {
    const std::filesystem::path scratch =
        std::filesystem::path(config.run.dir) / ".checkpoint-write-test";
    const auto [path, seconds] = write_checkpoint(scratch, 1);
    std::uintmax_t bytes = 0;
    if (world_rank == 0) {
      std::error_code error;
      bytes = std::filesystem::file_size(path, error);
      std::filesystem::remove_all(scratch, error);
    }
    char line[320];
    std::snprintf(line, sizeof line, "checkpoint write: %.1f MiB in %.2f s",
                  static_cast<double>(bytes) / (1024.0 * 1024.0), seconds);
    std::string text = line;
    if (options.kill_timeout_s > 0.0) {
      std::snprintf(line, sizeof line, "; a stop signal leaves %.0f s before SIGKILL (%s)",
                    options.kill_timeout_s, options.kill_timeout_source.c_str());
      text += line;
      // The stop waits for one block of the step in flight, then writes.
      const double needed = 3.0 * seconds + 5.0;
      if (needed > options.kill_timeout_s) {
        std::snprintf(line, sizeof line,
                      "\nwarning: a checkpoint on SIGTERM may not be written in time; launch with "
                      "mpiexec --mca odls_base_sigkill_timeout %.0f (or "
                      "OMPI_MCA_odls_base_sigkill_timeout=%.0f)",
                      std::ceil(needed), std::ceil(needed));
        text += line;
      }
    }
    log(text);
  }

  // On a stop: the checkpoint of the last completed step, unless there is one already or it would
  // not be written before the launcher's SIGKILL (all ranks agree on both).
  void final_checkpoint_on_stop() {
    if (!options.write_checkpoints) return;
    double votes[2] = {0.0, 0.0};  // ranks whose checkpoint of this step exists; ranks short of time
    if (world_rank == 0 && !last_checkpoint.empty() &&
        last_checkpoint == checkpoint_path(config.run.dir, steps_done)) {
      votes[0] = 1.0;
    }
    const double left = options.kill_timeout_s - seconds_since_stop();
    if (options.kill_timeout_s > 0.0 && checkpoint_seconds > left) votes[1] = 1.0;
    world->all_reduce_sum(votes, 2, DType::f64, nullptr);
    if (votes[0] > 0.0) return;
    if (votes[1] > 0.0) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "stop requested: no checkpoint of step %d: one takes %.1f s and SIGKILL comes "
                    "%.0f s after the signal (%s)",
                    steps_done, checkpoint_seconds, options.kill_timeout_s,
                    options.kill_timeout_source.c_str());
      log(line);
      return;
    }
    save_run_checkpoint();
  }

  // The checkpoint of steps_done into run.dir, said with its time (collective).
  void save_run_checkpoint() {
    const auto [path, seconds] =
        write_checkpoint(config.run.dir, std::max(1, config.train.keep_checkpoints));
    last_checkpoint = path;
    char took[64];
    std::snprintf(took, sizeof took, " (%.2f s)", seconds);
    log("checkpoint " + path.string() + took);
  }

  void log(const std::string& line) const {
    if (world_rank == 0 && options.log != nullptr) {
      *options.log << (terminal() ? "\r\033[K" : "") << line << '\n';
      options.log->flush();
    }
  }

  void progress(int step, int steps, double loss) const {
    if (world_rank != 0 || options.log == nullptr || !terminal()) return;
    constexpr int kWidth = 30;
    const int filled = steps > 0 ? step * kWidth / steps : kWidth;
    *options.log << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, ' ') << "] "
                 << step << "/" << steps << "  loss " << loss << std::flush;
  }

  // The optimizer step where stage i starts, and the training samples of every replica before it.
  int stage_first_step(int index) const {
    int first = 0;
    for (int i = 0; i < index; ++i) first += stages[static_cast<std::size_t>(i)].steps;
    return first;
  }
  std::uint64_t sequences_per_step(int index) const {
    const StageConfig& st = stages[static_cast<std::size_t>(index)];
    return static_cast<std::uint64_t>(base.train.grad_accum) * static_cast<std::uint64_t>(dp) *
           static_cast<std::uint64_t>(st.batch_size.value_or(base.train.batch_size));
  }
  // The training sequences of all replicas in the first `steps` optimizer steps.
  std::uint64_t sequences_before(int steps) const {
    std::uint64_t sequences = 0;
    for (int i = 0, first = 0; i < static_cast<int>(stages.size()); ++i) {
      const int in_stage = std::clamp(steps - first, 0, stages[static_cast<std::size_t>(i)].steps);
      sequences += static_cast<std::uint64_t>(in_stage) * sequences_per_step(i);
      first += stages[static_cast<std::size_t>(i)].steps;
    }
    return sequences;
  }

  std::unique_ptr<TrainModel> make_model(const TrainConfig& c) const {
    if (backend == Backend::cuda) {
      return make_cuda_model(c.model, c.train.batch_size, c.train.seq_len, device_cp, layout,
                             model_options, device_world);
    }
    return std::make_unique<CpuModel<float>>(c.model, c.train.batch_size, c.train.seq_len,
                                             cp_comm, layout, model_options, world);
  }

  // The data of `config` (its seq_len): the retrieval task or the datasets.
  void open_data() {
    task.reset();
    train_data.reset();
    val_data.reset();
    sampler.reset();
    if (config.data.source == DataSource::retrieval) {
      RetrievalSpec spec;
      spec.vocab_size = config.model.vocab_size;
      spec.seq_len = config.train.seq_len;
      spec.pairs = config.data.retrieval.pairs;
      spec.key_tokens = config.data.retrieval.key_tokens;
      spec.value_tokens = config.data.retrieval.value_tokens;
      spec.queries = config.data.retrieval.queries;
      spec.seed = config.train.seed;
      task.emplace(spec);
    } else {
      train_data.emplace(config.data.train_path, config.model.vocab_size, config.train.seq_len);
      sampler.emplace(config.train.seed, train_data->num_sequences());
      if (!config.data.val_path.empty()) {
        val_data.emplace(config.data.val_path, config.model.vocab_size, config.train.seq_len);
      }
    }
    resolve_documents();
  }

  // data.documents and model.rope_document_positions against the data: absent, documents are on
  // where the training dataset has them; asked for where it has none, an error naming the key.
  // (A validation dataset without them is one document.)
  void resolve_documents() {
    const bool available = train_data && train_data->has_documents();
    const std::optional<bool> asked = config.data.documents;
    const std::string file = train_data ? "token dataset '" + config.data.train_path + "'" : "";
    if (asked.value_or(false) && !available) {
      ringattn::detail::fail("Trainer", "data.documents is true but ", file,
                             " has no document_starts; write it with ringattn-data (each file, "
                             "or each --eod-token, begins a document), or set data.documents to "
                             "false");
    }
    documents = asked.value_or(available);
    if (config.model.rope_document_positions.value_or(false) && !documents) {
      ringattn::detail::fail("Trainer", "model.rope_document_positions is true but the sequences "
                             "carry no documents (", file.empty() ? "data.source retrieval" : file,
                             available ? ", data.documents false" : " has no document_starts",
                             "); set it to false or leave it out");
    }
  }

  // On a GPU, a later stage with more tokens a rank than the first would find out only when it
  // starts whether its model fits: make that model once here, before step 1, and let it go.
  void check_largest_stage_fits() {
    int largest = 0;
    const auto tokens = [&](int i) {
      const TrainConfig c = stage_config(base, i);
      return static_cast<std::int64_t>(c.train.batch_size) * c.train.seq_len;
    };
    for (int i = 1; i < static_cast<int>(stages.size()); ++i) {
      if (tokens(i) > tokens(largest)) largest = i;
    }
    if (largest == 0) return;
    const TrainConfig c = stage_config(base, largest);
    std::optional<Error> failure;
    try {
      try {
        make_model(c);
      } catch (const std::exception& e) {
        ringattn::detail::fail("Trainer", "train.stages[", largest, "] (seq_len ", c.train.seq_len,
                               ", batch_size ", c.train.batch_size, ") does not fit: ", e.what());
      }
    } catch (const std::exception& e) {
      failure = as_error("Trainer", e);
    }
    check_no_rank_failed(*world, "Trainer", failure ? &*failure : nullptr);
  }

  // Makes stage `index` the one being run: its config, shards, FLOPs a token, data and a model of
  // its shapes holding the parameters and moments of the model before (collective). The first
  // model is initialised from train.seed instead. The data and the model are made on every rank;
  // a rank that fails makes all fail alike.
  void enter_stage(int index) {
    if (index == stage) return;
    const bool first = model == nullptr;
    std::optional<Error> failure;
    std::vector<float> params, m, v;
    if (!first) {
      model->export_state(params, m, v);
      model.reset();  // its device memory goes before the next stage's is taken
    }
    stage = index;
    config = stage_config(base, index);
    ranges = layout_ranges({});  // balanced: the ranges of a micro-batch without documents
    flops_per_token = model_flops_per_token(model_shape(config.model), config.train.seq_len);
    // Each rank may read its own copy of the datasets (their paths may differ): the copies must
    // hold the same tokens, or the replicas and the ring's shards would train on different data.
    // Reading one (a token outside the vocabulary) fails like opening it: said once where every
    // rank's copy has the fault.
    std::string identity;
    try {
      model = make_model(config);
      open_data();
      if (first && train_data) {
        identity = "data.train_path " + train_data->identity();
        if (val_data) identity += "; data.val_path " + val_data->identity();
      }
    } catch (const std::exception& e) {
      failure = as_error("Trainer", e);
    }
    check_no_rank_failed(*world, "Trainer", failure ? &*failure : nullptr);
    if (first && train_data) check_same_on_all_ranks(*world, "Trainer", identity);
    if (first) {
      model->init(config.train.seed);
    } else {
      model->import_state(params, m, v);
    }
    if (!first) {
      log("stage " + std::to_string(index + 1) + "/" + std::to_string(stages.size()) +
          " from step " + std::to_string(stage_first_step(index) + 1) + ": seq_len " +
          std::to_string(config.train.seq_len) + ", batch " +
          std::to_string(config.train.batch_size) + ", " + std::to_string(stages[index].steps) +
          " steps");
    }
  }

  // The micro-batch of this rank: samples [first, first + batch) of the split.
  MicroBatch load(std::uint64_t first, bool held_out, std::vector<RetrievalSample>* samples) const {
    MicroBatch mb;
    const int batch = config.train.batch_size;
    const TokenDataset* data = task ? nullptr : held_out ? &*val_data : &*train_data;
    const auto sequence_of = [&](int b) {
      const std::uint64_t n = first + static_cast<std::uint64_t>(b);
      return held_out
                 ? static_cast<std::int64_t>(n % static_cast<std::uint64_t>(data->num_sequences()))
                 : sampler->sequence(n);
    };
    // The balanced layout follows the micro-batch's documents: its ranges come first.
    std::vector<TokenRange> batch_ranges = ranges;
    if (config.parallel.layout == ShardLayout::balanced && data != nullptr && documents) {
      std::vector<std::vector<std::int64_t>> rows;
      for (int b = 0; b < batch; ++b) rows.push_back(data->sequence_document_starts(sequence_of(b)));
      batch_ranges = layout_ranges(pad_document_lists(rows, config.train.seq_len));
    }
    std::vector<std::vector<std::int64_t>> document_rows;
    for (int b = 0; b < batch; ++b) {
      const std::uint64_t n = first + static_cast<std::uint64_t>(b);
      TokenShard shard;
      if (task) {
        RetrievalSample s =
            task->sample(held_out ? RetrievalSplit::held_out : RetrievalSplit::train, n);
        shard = take_shard(s.tokens, s.loss_mask, batch_ranges);
        if (samples != nullptr) samples->push_back(std::move(s));
      } else {
        shard = data->read_shard(sequence_of(b), batch_ranges, documents);
      }
      mb.inputs.insert(mb.inputs.end(), shard.inputs.begin(), shard.inputs.end());
      mb.targets.insert(mb.targets.end(), shard.targets.begin(), shard.targets.end());
      mb.mask.insert(mb.mask.end(), shard.loss_mask.begin(), shard.loss_mask.end());
      document_rows.push_back(std::move(shard.document_starts));
    }
    DocumentBatch padded = pad_document_lists(document_rows, config.train.seq_len);
    mb.documents = std::move(padded.starts);
    mb.document_count = padded.count;
    for (const TokenRange& range : batch_ranges) {
      for (std::int64_t p = range.begin; p < range.end; ++p) mb.positions.push_back(p);
    }
    for (float w : mb.mask) mb.weight += w;
    return mb;
  }

  // This rank's ranges of a sequence in a micro-batch with these documents (padded rows, count 0:
  // none): the layout's, or under the balanced layout the ones the ring lays out for the batch's
  // mask (causal, model.attention_window, the documents), as the model checks.
  std::vector<TokenRange> layout_ranges(const DocumentBatch& documents) const {
    const int seq = config.train.seq_len;
    if (config.parallel.layout != ShardLayout::balanced) {
      return shard_ranges(seq, cp, cp_rank, config.parallel.layout);
    }
    Mask mask;
    mask.causal = true;
    mask.window_left = config.model.attention_window;
    if (documents.count > 0) {
      mask.documents = DocumentStarts{documents.starts.data(), documents.count, documents.count};
    }
    const auto assignment =
        balanced_assignment(cp, seq, RingMask{mask, config.train.batch_size});
    std::vector<TokenRange> out;
    for (const SequenceChunk& c : (*assignment)[static_cast<std::size_t>(cp_rank)]) {
      out.push_back({c.global_start, c.global_start + c.length});
    }
    return out;
  }

  // The end of run() on rank 0: what a person wants to see (the last loss and evaluation,
  // throughput, memory, wall time and where the files are), and the PNG of the curves beside
  // metrics.jsonl (train/plot_png.hpp).
  void report_summary(const std::vector<StepMetrics>& run_steps) {
    if (world_rank != 0 || options.log == nullptr || run_steps.empty()) return;
    const StepMetrics& last = run_steps.back();
    // Throughput: the median over the last stage's steps of this run, its first left out where
    // more follow (it pays for allocations and algorithm choices).
    std::vector<const StepMetrics*> timed;
    for (std::size_t i = 0; i < run_steps.size(); ++i) {
      if (stage_of_metrics[i] == stage_of_metrics.back()) timed.push_back(&run_steps[i]);
    }
    if (timed.size() > 1) timed.erase(timed.begin());
    std::sort(timed.begin(), timed.end(), [](const StepMetrics* a, const StepMetrics* b) {
      return a->tokens_per_s < b->tokens_per_s;
    });
    const StepMetrics& median = *timed[timed.size() / 2];
    double peak_mib = 0.0;
    for (const StepMetrics& m : run_steps) peak_mib = std::max(peak_mib, m.peak_memory_mib);
    const double wall_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const std::filesystem::path dir(config.run.dir);
    std::string png_note;
    if (options.write_metrics) {
      try {
        write_metrics_png(dir / "metrics.jsonl", dir / "metrics.png");
      } catch (const std::exception& e) {
        png_note = std::string(" (not written: ") + e.what() + ")";
      }
    }
    char line[256];
    log("summary");
    std::snprintf(line, sizeof line, "  steps        %d of %d, seq_len %d", last.step,
                  base.train.steps, config.train.seq_len);
    log(line);
    std::snprintf(line, sizeof line, "  final loss   %.4f (step %d)", last.loss, last.step);
    log(line);
    if (last_eval) {
      std::string text;
      std::snprintf(line, sizeof line, "  held-out     loss %.4f", last_eval->loss);
      text = line;
      if (last_eval->accuracy >= 0.0) {
        std::snprintf(line, sizeof line, ", retrieval accuracy %.3f", last_eval->accuracy);
        text += line;
      }
      std::snprintf(line, sizeof line, " (step %d)", last_eval->step);
      log(text + line);
    }
    std::snprintf(line, sizeof line, "  throughput   %.0f tokens/s (median of the stage's steps)",
                  median.tokens_per_s);
    std::string text = line;
    if (median.mfu > 0.0) {
      std::snprintf(line, sizeof line, ", MFU %.1f%%", 100.0 * median.mfu);
      text += line;
    }
    log(text);
    std::snprintf(line, sizeof line, "  peak memory  %.0f MiB %s", peak_mib,
                  backend == Backend::cuda ? "(device, rank 0)" : "(resident, rank 0)");
    log(line);
    std::snprintf(line, sizeof line, "  wall time    %.1f s", wall_s);
    log(line);
    if (options.write_metrics) {
      log("  metrics      " + (dir / "metrics.jsonl").string());
      log("  plot         " + (dir / "metrics.png").string() + png_note);
    }
    if (!last_checkpoint.empty()) log("  checkpoint   " + last_checkpoint.string());
  }

  // The profile of the steps so far (train.profile) on rank 0, slowest phase first: a table on the
  // log and <run.dir>/profile.json. "untracked" is the steps' wall time that no phase holds.
  void report_profile() const {
    if (world_rank != 0 || profiled_steps == 0) return;
    std::vector<PhaseTime> phases = model->phase_times();
    std::stable_sort(phases.begin(), phases.end(), [](const PhaseTime& a, const PhaseTime& b) {
      return a.total_ms > b.total_ms;
    });
    double phases_ms = 0.0;
    for (const PhaseTime& p : phases) phases_ms += p.total_ms;
    const double untracked_ms = profiled_ms - phases_ms;
    const double steps = profiled_steps;
    const auto share = [&](double ms) { return profiled_ms > 0.0 ? ms / profiled_ms : 0.0; };
    char line[256];
    std::snprintf(line, sizeof line, "profile of rank 0 (%s): %d steps, %.3f ms per step",
                  model->backend_name().c_str(), profiled_steps, profiled_ms / steps);
    log(line);
    std::snprintf(line, sizeof line, "  %-26s %8s %12s %10s %7s", "phase", "calls", "total ms",
                  "ms/step", "share");
    log(line);
    for (const PhaseTime& p : phases) {
      std::snprintf(line, sizeof line, "  %-26s %8lld %12.3f %10.3f %6.1f%%", p.name.c_str(),
                    static_cast<long long>(p.calls), p.total_ms, p.total_ms / steps,
                    100.0 * share(p.total_ms));
      log(line);
    }
    std::snprintf(line, sizeof line, "  %-26s %8s %12.3f %10.3f %6.1f%%",
                  "untracked (wall - phases)", "", untracked_ms, untracked_ms / steps,
                  100.0 * share(untracked_ms));
    log(line);
    if (!options.write_metrics) return;
    const std::filesystem::path path = std::filesystem::path(config.run.dir) / "profile.json";
    std::ofstream out(path);
    out << "{\"rank\": 0, \"backend\": \"" << model->backend_name()
        << "\", \"steps\": " << profiled_steps
        << ", \"step_ms\": " << format_double(profiled_ms / steps)
        << ", \"total_ms\": " << format_double(profiled_ms) << ",\n \"phases\": [";
    const char* separator = "\n  ";
    for (const PhaseTime& p : phases) {
      out << separator << "{\"name\": \"" << p.name << "\", \"calls\": " << p.calls
          << ", \"total_ms\": " << format_double(p.total_ms)
          << ", \"ms_per_step\": " << format_double(p.total_ms / steps)
          << ", \"share\": " << format_double(share(p.total_ms)) << "}";
      separator = ",\n  ";
    }
    out << "],\n \"untracked\": {\"total_ms\": " << format_double(untracked_ms)
        << ", \"ms_per_step\": " << format_double(untracked_ms / steps)
        << ", \"share\": " << format_double(share(untracked_ms)) << "}}\n";
    out.close();
    if (!out) ringattn::detail::fail("Trainer::run", "cannot write ", path.string());
    log("profile " + path.string());
  }
};

Trainer::Trainer(const TrainConfig& config, std::shared_ptr<Communicator> world,
                 TrainerOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.base = config;
  s.stages = run_stages(config.train);
  s.options = options;
  s.world = std::move(world);
  // Every key alike on every rank (a launch that gave its ranks different configs would otherwise
  // train diverging replicas or wait forever in a collective), before anything depends on them. The
  // dataset paths may differ (a copy on each node's own disk).
  TrainConfig compared = config;
  compared.data.train_path.clear();
  compared.data.val_path.clear();
  check_same_on_all_ranks(*s.world, "Trainer", config_items(compared));
  {
    std::optional<Error> failure;
    try {
      validate(config, s.world->size());
      s.backend = resolve_backend(config.run.backend);
      if (s.backend == Backend::cuda) validate_for_cuda(config);
      // What a rank's model and steps take, against what the host (and GPU) has: a config that
      // cannot fit is refused here, naming its keys, before any of it is allocated.
      const double device_bytes = s.backend == Backend::cuda ? cuda_device_memory_bytes() : 0.0;
      s.offload = resolve_offload(config, s.backend, device_bytes);
      check_run_memory(offload_resolved(config, s.offload), s.backend, device_bytes);
    } catch (const std::exception& e) {
      failure = as_error("Trainer", e);
    }
    check_no_rank_failed(*s.world, "Trainer", failure ? &*failure : nullptr);
  }
  s.world_rank = s.world->rank();
  s.dp = config.parallel.dp;
  s.cp = config.parallel.cp;
  s.dp_rank = s.world_rank / s.cp;
  s.cp_rank = s.world_rank % s.cp;
  s.cp_comm = split_communicator(*s.world, s.dp_rank, s.cp_rank);
  static_assert(static_cast<int>(ShardLayout::contiguous) ==
                    static_cast<int>(SequenceLayoutKind::contiguous) &&
                static_cast<int>(ShardLayout::zigzag) == static_cast<int>(SequenceLayoutKind::zigzag) &&
                static_cast<int>(ShardLayout::balanced) ==
                    static_cast<int>(SequenceLayoutKind::balanced));
  s.layout = static_cast<SequenceLayoutKind>(config.parallel.layout);
  s.model_options.recompute = config.train.recompute;
  s.model_options.recompute_attention = config.train.recompute_attention;
  s.model_options.loss_chunk_tokens = config.train.loss_chunk_tokens;
  s.model_options.mlp_chunk_tokens = config.train.mlp_chunk_tokens;
  s.model_options.offload = s.offload;
  s.model_options.shard_optimizer = config.train.shard_optimizer;
  s.model_options.deterministic = config.train.deterministic;
  s.model_options.local_attention = config.parallel.local_attention;
  // Whether batches carry documents is the data's (open_data); where they do, RoPE restarts at
  // them unless the config says otherwise.
  s.model_options.rope_document_positions = config.model.rope_document_positions.value_or(true);
  if (s.options.stop_requested != nullptr) {
    // Every rank asks at the same boundaries, so all stop at the same one.
    s.model_options.layer_boundary = [&s] {
      if (s.stop_agreed()) throw StepInterrupted{};
    };
  }
  if (s.backend == Backend::cuda) {
    // The ring and the gradients move device memory over NCCL, bootstrapped from the world's MPI
    // communicator; host scalars keep going through `world`.
    const auto* mpi = dynamic_cast<const MpiCommunicator*>(s.world.get());
    if (mpi == nullptr) {
      ringattn::detail::fail("Trainer", "run.backend is cuda; the world communicator must be an "
                             "MPI communicator (NCCL is bootstrapped from it)");
    }
    s.device_world = nccl_communicator_over(mpi->handle());
    s.device_cp = split_communicator(*s.device_world, s.dp_rank, s.cp_rank);
    s.peak_flops = cuda_peak_bf16_flops();
    s.device_in_use_before_model = cuda_device_memory_in_use_bytes();
    s.check_largest_stage_fits();
  }
  s.enter_stage(0);
  // The checkpoint is opened on every rank; a rank that fails makes all fail alike (instead of
  // leaving the others waiting in the first collective).
  std::optional<Error> failure;
  // What each rank resumed from: they must agree (a rank that found no checkpoint, or another one,
  // would train from other weights).
  std::string resumed = "resumed step none";
  try {
    s.log("ringattn-train: world " + std::to_string(s.world->size()) + " = dp " +
          std::to_string(s.dp) + " x cp " + std::to_string(s.cp) + " (" +
          std::string(layout_name(config.parallel.layout)) + "), backend " +
          s.model->backend_name() +
          (s.backend == Backend::cpu ? " (" + threads_phrase(ringattn::cpu::num_threads()) + ")"
                                     : std::string()) +
          (config.train.recompute
               ? (config.train.recompute_attention ? " (recompute, attention included)"
                                                   : " (recompute)")
               : "") +
          (config.parallel.local_attention ? ", attention within each shard only (control)" : "") +
          (s.documents ? (s.model_options.rope_document_positions
                              ? ", packed documents (RoPE per document)"
                              : ", packed documents (RoPE at sequence positions)")
                       : "") +
          (config.model.attention_window > 0
               ? ", attention window " + std::to_string(config.model.attention_window)
               : "") +
          ", " +
          std::to_string(parameter_count()) + " parameters, data " +
          std::string(source_name(config.data.source)));
    s.log(memory_account_text(offload_resolved(config, s.offload), s.backend, false,
                              s.device_in_use_before_model));
    if (s.stages.size() > 1) {
      std::string plan = "stages:";
      for (std::size_t i = 0; i < s.stages.size(); ++i) {
        const TrainConfig c = stage_config(config, static_cast<int>(i));
        plan += std::string(i == 0 ? " " : ", then ") + std::to_string(s.stages[i].steps) +
                " steps at seq_len " + std::to_string(c.train.seq_len) + " (batch " +
                std::to_string(c.train.batch_size) + ")";
      }
      s.log(plan);
    }
    if (s.world_rank == 0 && s.options.write_metrics) {
      std::filesystem::create_directories(config.run.dir);
    }
    if (const auto resume = resolve_resume(config.run.dir, config.run.resume)) {
      std::vector<CheckpointTensorSlot> slots;
      std::vector<float> params, m, v;
      s.model->export_state(params, m, v);
      std::size_t offset = 0;
      for (const ParameterInfo& info : s.model->parameter_infos()) {
        slots.push_back({info.name, info.shape, params.data() + offset});
        slots.push_back({"adam_m." + info.name, info.shape, m.data() + offset});
        slots.push_back({"adam_v." + info.name, info.shape, v.data() + offset});
        offset += static_cast<std::size_t>(info.elements);
      }
      const CheckpointState state = load_checkpoint(*resume, slots);
      if (state.step > config.train.steps) {
        ringattn::detail::fail("Trainer", "checkpoint '", resume->string(), "' is of step ",
                               state.step, ", past train.steps = ", config.train.steps,
                               ": nothing is left to train (set train.steps above ", state.step,
                               " to train on from it)");
      }
      Digest digest;
      for (const std::vector<float>* part : {&params, &m, &v}) {
        digest.add(part->data(), part->size() * sizeof(float));
      }
      resumed = "resumed step " + std::to_string(state.step) + "; resumed state digest " +
                digest.hex();
      s.model->import_state(params, m, v);
      s.steps_done = static_cast<int>(state.step);
      s.log("resumed from " + resume->string() + " at step " + std::to_string(s.steps_done));
    }
  } catch (const std::exception& e) {
    failure = as_error("Trainer", e);
  }
  check_no_rank_failed(*s.world, "Trainer", failure ? &*failure : nullptr);
  check_same_on_all_ranks(*s.world, "Trainer", resumed);
  // A run resumed in a later stage goes on in it.
  s.enter_stage(stage_of_step(config.train, s.steps_done));
}

void Trainer::save_checkpoint() {
  impl_->save_run_checkpoint();
}

Trainer::~Trainer() = default;

int Trainer::steps_done() const {
  return impl_->steps_done;
}

std::int64_t Trainer::parameter_count() const {
  return impl_->model->parameter_count();
}

StepMetrics Trainer::step() {
  Impl& s = *impl_;
  const auto start = std::chrono::steady_clock::now();
  const int step = s.steps_done;
  s.enter_stage(stage_of_step(s.base.train, step));
  const TrainingConfig& t = s.config.train;
  if (s.first_step < 0) s.first_step = step;
  const bool profiled = t.profile && (step > s.first_step || step + 1 >= t.steps);
  if (profiled) s.model->start_profiled_step();
  std::vector<MicroBatch> micro;
  double weights[2] = {0.0, 0.0};  // the step's loss-mask sum, then its loss sum
  // The samples of a stage follow those of the stages before it.
  const std::uint64_t stage_first = s.sequences_before(s.stage_first_step(s.stage));
  const auto stage_step = static_cast<std::uint64_t>(step - s.stage_first_step(s.stage));
  for (int m = 0; m < t.grad_accum; ++m) {
    const std::uint64_t first =
        stage_first + ((stage_step * t.grad_accum + m) * s.dp + s.dp_rank) *
                          static_cast<std::uint64_t>(t.batch_size);
    micro.push_back(s.load(first, false, nullptr));
    weights[0] += micro.back().weight;
  }
  s.world->all_reduce_sum(weights, 1, DType::f64, nullptr);
  const double total_weight = weights[0];
  if (!(total_weight > 0.0)) {
    ringattn::detail::fail("Trainer::step", "step ", step + 1,
                           ": the loss mask of the step's tokens sums to 0");
  }
  TrainModel& model = *s.model;
  model.zero_grad();
  double loss_sum = 0.0;
  for (const MicroBatch& mb : micro) {
    loss_sum += model.forward_backward(mb.view(), 1.0 / total_weight).loss_sum;
  }
  s.world->all_reduce_sum(&loss_sum, 1, DType::f64, nullptr);
  const double loss = loss_sum / total_weight;
  if (!std::isfinite(loss)) {
    const std::string where = model.first_non_finite_tensor();
    ringattn::detail::fail("Trainer::step", "the loss is ", loss, " at step ", step + 1,
                           where.empty() ? std::string(" (every tensor kept is finite: the logits)")
                                         : " (first non-finite: " + where + ")");
  }
  model.all_reduce_gradients();
  cpu::AdamWHyper hyper;
  hyper.lr = learning_rate(t, step);
  hyper.beta1 = t.beta1;
  hyper.beta2 = t.beta2;
  hyper.eps = t.adam_eps;
  hyper.weight_decay = t.weight_decay;
  // The clip factor is formed beside the gradients, so that on a GPU AdamW follows the norm
  // without waiting for the host; a norm that is not finite leaves the parameters as they were.
  const double sum_sq = model.clip_and_adamw(hyper, step + 1, t.grad_clip);
  const double grad_norm = std::sqrt(sum_sq);
  if (!std::isfinite(grad_norm)) {
    const std::string where = model.first_non_finite_gradient();
    ringattn::detail::fail("Trainer::step", "the gradient norm is ", grad_norm, " at step ",
                           step + 1, " (first in the gradient of ", where.empty() ? "?" : where,
                           ")");
  }
  // The profile waits for the step's last op, so its wall time holds all of the step's work.
  if (profiled) model.finish_profiled_step();
  s.steps_done = step + 1;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (profiled) {
    ++s.profiled_steps;
    s.profiled_ms += 1e3 * seconds;
  }
  StepMetrics metrics;
  metrics.step = step + 1;
  metrics.loss = loss;
  metrics.lr = hyper.lr;
  metrics.grad_norm = grad_norm;
  metrics.seconds = seconds;
  metrics.unix_time = std::chrono::duration<double>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const double tokens = static_cast<double>(t.grad_accum) * s.dp * t.batch_size * t.seq_len;
  metrics.tokens_per_s = seconds > 0.0 ? tokens / seconds : 0.0;
  metrics.mfu = s.peak_flops > 0.0
                    ? metrics.tokens_per_s * s.flops_per_token / (s.peak_flops * s.world->size())
                    : 0.0;
  if (s.backend == Backend::cuda) {
    metrics.peak_memory_mib = model.device_memory_mib();
  } else {
    rusage usage{};
    if (getrusage(RUSAGE_SELF, &usage) == 0) metrics.peak_memory_mib = usage.ru_maxrss / 1024.0;  // KiB
  }
  return metrics;
}

EvalMetrics Trainer::evaluate() {
  Impl& s = *impl_;
  const TrainingConfig& t = s.config.train;
  EvalMetrics out;
  out.step = s.steps_done;
  if (!s.task && !s.val_data) return out;
  TrainModel& model = *s.model;
  double sums[4] = {0.0, 0.0, 0.0, 0.0};  // loss, weight, queries, correct
  std::vector<std::int32_t> predictions(model.local_tokens());
  std::vector<double> full;
  for (int batch = 0; batch < t.eval_batches; ++batch) {
    const std::uint64_t first = (static_cast<std::uint64_t>(batch) * s.dp + s.dp_rank) *
                                static_cast<std::uint64_t>(t.batch_size);
    std::vector<RetrievalSample> samples;
    const MicroBatch mb = s.load(first, true, &samples);
    const cpu::CrossEntropySums ce = model.forward(mb.view(), predictions);
    sums[0] += ce.loss_sum;
    sums[1] += ce.weight_sum;
    if (!s.task) continue;
    // Gather the predictions of the whole sequences over the ring (each rank writes its tokens).
    full.assign(static_cast<std::size_t>(t.batch_size) * t.seq_len, 0.0);
    const std::int64_t sl = model.local_len();
    for (int b = 0; b < t.batch_size; ++b) {
      for (std::int64_t local = 0; local < sl; ++local) {
        full[static_cast<std::size_t>(b) * t.seq_len + mb.positions[local]] =
            predictions[b * sl + local];
      }
    }
    s.cp_comm->all_reduce_sum(full.data(), full.size(), DType::f64, nullptr);
    if (s.cp_rank != 0) continue;  // count each sample once per replica
    for (int b = 0; b < t.batch_size; ++b) {
      std::vector<std::int32_t> answers;
      for (std::int64_t target : samples[b].answer_targets) {
        answers.push_back(
            static_cast<std::int32_t>(full[static_cast<std::size_t>(b) * t.seq_len + target]));
      }
      const RetrievalScore score =
          score_answers(samples[b], s.config.data.retrieval.value_tokens, answers);
      sums[2] += static_cast<double>(score.queries);
      sums[3] += static_cast<double>(score.correct);
    }
  }
  s.world->all_reduce_sum(sums, 4, DType::f64, nullptr);
  out.loss = sums[1] > 0.0 ? sums[0] / sums[1] : 0.0;
  if (s.task) out.accuracy = sums[2] > 0.0 ? sums[3] / sums[2] : 0.0;
  return out;
}

std::vector<StepMetrics> Trainer::run() {
  Impl& s = *impl_;
  const TrainingConfig& t = s.config.train;
  std::ofstream metrics_file;
  std::optional<Error> failure;
  if (s.world_rank == 0 && s.options.write_metrics) {
    const std::filesystem::path path = std::filesystem::path(s.config.run.dir) / "metrics.jsonl";
    metrics_file.open(path, std::ios::app);
    if (!metrics_file) {
      failure = Error("Trainer::run",
                      "cannot open " + path.string() + " for appending: " + std::strerror(errno),
                      ErrorKind::io);
    }
  }
  check_no_rank_failed(*s.world, "Trainer::run", failure ? &*failure : nullptr);
  std::vector<StepMetrics> all;
  s.stage_of_metrics.clear();
  if (s.options.stop_requested != nullptr && s.options.write_checkpoints) {
    s.measure_checkpoint_write();
  }
  while (s.steps_done < t.steps) {
    StepMetrics m;
    try {
      m = step();
    } catch (const StepInterrupted&) {
      // Every rank stopped at the same block boundary of step steps_done + 1, before its
      // optimizer update: the parameters and moments are those of step steps_done.
      s.log("stop requested: step " + std::to_string(s.steps_done + 1) +
            " abandoned at a block boundary; the parameters are those after step " +
            std::to_string(s.steps_done));
      s.final_checkpoint_on_stop();
      break;
    }
    if (metrics_file.is_open()) {
      metrics_file << "{\"step\": " << m.step << ", \"loss\": " << format_double(m.loss)
                   << ", \"lr\": " << format_double(m.lr)
                   << ", \"grad_norm\": " << format_double(m.grad_norm)
                   << ", \"tokens_per_s\": " << format_double(m.tokens_per_s)
                   << ", \"mfu\": " << format_double(m.mfu)
                   << ", \"seconds\": " << format_double(m.seconds)
                   << ", \"time\": " << format_double(m.unix_time, 3)
                   << ", \"peak_memory_mib\": " << format_double(m.peak_memory_mib) << "}\n";
      metrics_file.flush();
    }
    if (t.log_every > 0 && (m.step % t.log_every == 0 || m.step == 1 || m.step == t.steps)) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "step %d/%d  loss %.4f  lr %.3e  grad_norm %.4f  tokens/s %.0f", m.step,
                    t.steps, m.loss, m.lr, m.grad_norm, m.tokens_per_s);
      std::string text = line;
      if (m.mfu > 0.0) {
        std::snprintf(line, sizeof line, "  mfu %.1f%%", 100.0 * m.mfu);
        text += line;
      }
      std::snprintf(line, sizeof line, "  peak %.0f MiB", m.peak_memory_mib);
      s.log(text + line);
    }
    s.progress(m.step, t.steps, m.loss);
    // Evaluations every eval_every steps, at the end, and at the end of each stage (at the
    // context of the stage that ends).
    const bool stage_ends =
        s.stages.size() > 1 && m.step == s.stage_first_step(s.stage) + s.stages[s.stage].steps;
    if (t.eval_every > 0 && (m.step % t.eval_every == 0 || m.step == t.steps || stage_ends)) {
      const EvalMetrics e = evaluate();
      s.last_eval = e;
      char line[256];
      if (e.accuracy >= 0.0) {
        std::snprintf(line, sizeof line,
                      "eval step %d  seq_len %d  loss %.4f  retrieval accuracy %.3f", e.step,
                      t.seq_len, e.loss, e.accuracy);
      } else {
        std::snprintf(line, sizeof line, "eval step %d  seq_len %d  loss %.4f", e.step, t.seq_len,
                      e.loss);
      }
      s.log(line);
      if (metrics_file.is_open()) {
        metrics_file << "{\"step\": " << e.step << ", \"seq_len\": " << t.seq_len
                     << ", \"eval_loss\": " << format_double(e.loss);
        if (e.accuracy >= 0.0) metrics_file << ", \"eval_accuracy\": " << format_double(e.accuracy);
        metrics_file << "}\n";
        metrics_file.flush();
      }
    }
    const bool last = s.steps_done == t.steps;
    if (s.options.write_checkpoints &&
        (last || (t.checkpoint_every > 0 && m.step % t.checkpoint_every == 0))) {
      save_checkpoint();
    }
    all.push_back(m);
    s.stage_of_metrics.push_back(s.stage);
    if (s.options.stop_requested != nullptr && !last && s.stop_agreed()) {
      s.log("stop requested: stopping after step " + std::to_string(m.step));
      s.final_checkpoint_on_stop();
      break;
    }
  }
  if (t.profile) s.report_profile();
  if (metrics_file.is_open()) metrics_file.close();
  s.report_summary(all);
  return all;
}

}  // namespace ringattn::train
