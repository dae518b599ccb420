// ringattn-plan: DESIGN.md's performance model for your cluster. Says whether a ring step's K/V
// transfer hides behind its compute, from how many tokens per rank it does, and the longest
// sequence whose attention (forward + backward) fits in the GPUs' memory. Then, for the mask
// (causal or full, a sliding window, packed documents), the ring's steps (how far K/V travel) and
// each rank's share of the visible (query, key) pairs, with the most loaded rank over the mean.
// With --config, a training run's memory instead (train/model_memory.hpp): the account of the
// config (bytes a local token and fixed bytes by component, the predicted peak), then the longest
// train.seq_len that fits 1, 2, 4 and 8 GPUs of --memory-gib with the config's other keys.
//
//   ringattn-plan --ranks 2 --seq 131072 --heads 16 --head-dim 128 --causal \
//       --tflops 400 --link-gbps 205 --memory-gib 139
//   ringattn-plan --ranks 8 --seq 1048576 --layout contiguous --window-left 4096
//   ringattn-plan --ranks 8 --seq 1048576 --documents lognormal:8192:1
//   ringattn-plan --config configs/long-2gpu.yaml --set train.recompute_attention=false
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "parallel/performance_model.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/error.hpp"
#include "tools/cli_checks.hpp"
#include "train/config.hpp"
#include "train/model_memory.hpp"

namespace {

// The account of the config at FILE (with the --set assignments) on `backend` ("" : run.backend,
// auto counting as cuda), then the longest seq_len for 1, 2, 4 and 8 GPUs of `memory_gib`, each
// with `host_gib` of host memory (0: not limited).
int print_memory_account(const std::string& file, const std::vector<std::string>& assignments,
                         const std::string& backend_text, double memory_gib, double host_gib) {
  namespace train = ringattn::train;
  train::TrainConfig config = train::load_config_file(file);
  train::apply_overrides(config, assignments);
  train::validate(config, config.parallel.dp * config.parallel.cp);
  train::Backend backend =
      config.run.backend == train::Backend::cpu ? train::Backend::cpu : train::Backend::cuda;
  if (!backend_text.empty()) {
    backend = backend_text == "cpu" ? train::Backend::cpu : train::Backend::cuda;
  }
  if (backend == train::Backend::cuda) train::validate_for_cuda(config);
  const double bytes = memory_gib * 0x1p30;
  // train.offload auto as the trainer resolves it on a GPU of --memory-gib.
  const auto resolved = [&](const train::TrainConfig& c) {
    return train::offload_resolved(c, train::resolve_offload(c, backend, bytes));
  };
  std::printf("%s\n", file.c_str());
  std::printf("%s\n", train::memory_account_text(resolved(config), backend, true).c_str());
  std::printf("\nlongest train.seq_len that fits, %g GiB a GPU%s (parallel.cp = GPUs, dp 1):\n",
              memory_gib,
              host_gib > 0.0 ? (" and " + std::to_string(static_cast<long long>(host_gib)) +
                                " GiB of host memory a GPU").c_str()
                             : "");
  std::printf("  %4s %14s %16s %14s %14s %8s\n", "GPUs", "seq_len", "tokens a rank", "peak GiB",
              "host GiB", "offload");
  for (const int gpus : {1, 2, 4, 8}) {
    const std::int64_t seq_len =
        train::longest_fitting_seq_len(config, backend, gpus, bytes, host_gib * 0x1p30);
    if (seq_len == 0) {
      std::printf("  %4d %14s\n", gpus, "none fits");
      continue;
    }
    train::TrainConfig fitted = config;
    fitted.parallel.cp = gpus;
    fitted.parallel.dp = 1;
    fitted.train.stages.clear();
    fitted.train.seq_len = static_cast<int>(seq_len);
    fitted = resolved(fitted);
    const train::MemoryAccount account = train::memory_account(fitted, backend);
    std::printf("  %4d %14lld %16.0f %14.2f %14.2f %8s\n", gpus, static_cast<long long>(seq_len),
                account.local_tokens, account.peak_bytes() / 0x1p30,
                account.host_bytes() / 0x1p30,
                fitted.train.offload == train::Offload::on ? "on" : "off");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  namespace tools = ringattn::tools;
  CLI::App app{"ringattn-plan: when ring attention's communication hides, and what fits"};
  ringattn::RingPlanInput in;
  std::string layout = "zigzag";
  // Up to 2^24 GPUs: the model doubles the count in 32 bits (2 x ranks, zigzag).
  app.add_option("--ranks", in.ranks, "GPUs in the ring")->check(tools::whole_number(1, 1 << 24));
  app.add_option("--seq", in.seq,
                 "total sequence length, a multiple of 2 x --ranks (zigzag) or --ranks")
      ->check(tools::whole_number(1));
  app.add_option("--heads", in.heads, "query heads")->check(tools::whole_number(1));
  app.add_option("--kv-heads", in.kv_heads, "key/value heads, dividing --heads (default: --heads)")
      ->check(tools::whole_number(1));
  app.add_option("--head-dim", in.head_dim, "head dimension")->check(tools::whole_number(1));
  bool full = false;
  CLI::Option* causal = app.add_flag("--causal", in.causal, "causal mask (the default)");
  app.add_flag("--full", full, "full (non-causal) mask")->excludes(causal);
  app.add_option("--layout", layout, "zigzag, contiguous or balanced (by the mask's work)")
      ->check(CLI::IsMember({"zigzag", "contiguous", "balanced"}));
  app.add_option("--tflops", in.attention_tflops, "achieved attention TFLOP/s of the local block")
      ->check(tools::positive_real());
  app.add_option("--link-gbps", in.link_gbytes_per_s, "link bandwidth per direction, GB/s")
      ->check(tools::positive_real());
  app.add_option("--memory-gib", in.memory_gib, "device memory per GPU, GiB")
      ->check(tools::positive_real());
  app.add_option("--element-bytes", in.element_bytes, "2 for bf16/f16, 4 for f32")
      ->check(CLI::IsMember({"2", "4"}));  // text: of an int set, CLI11 names "two" without the set
  std::int64_t window_left = 0, window_right = 0;
  std::string documents;
  app.add_option("--window-left", window_left,
                 "sliding window: a query sees keys fewer than this many positions back (0: none)")
      ->check(tools::whole_number(0));
  app.add_option("--window-right", window_right,
                 "sliding window: ... and fewer than this many positions ahead (0: none)")
      ->check(tools::whole_number(0));
  app.add_option("--documents", documents,
                 "packed documents: lognormal:MEAN:SEED[:LONG] (log-normal lengths of mean MEAN "
                 "tokens, sigma 1, and one of LONG tokens) or file:PATH (the starts)");
  std::string config_file, backend;
  std::vector<std::string> assignments;
  CLI::Option* config = app.add_option(
      "--config", config_file,
      "a ringattn-train config: print its memory account and the longest seq_len that fits 1, "
      "2, 4 and 8 GPUs of --memory-gib, instead of the attention plan");
  app.add_option("--set", assignments, "with --config: override a config key (key=value)")
      ->needs(config);
  app.add_option("--backend", backend, "with --config: cuda or cpu (default: run.backend)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->needs(config);
  double host_gib = 0.0;
  app.add_option("--host-memory-gib", host_gib,
                 "with --config: host memory a GPU may take, GiB (the offloaded inputs, batches, "
                 "checkpoint copy; default: not limited)")
      ->check(tools::positive_real())
      ->needs(config);
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);
  if (line.exit_code >= 0) return tools::finish_command_line(line, "ringattn-plan");
  if (!config_file.empty() || app.count("--config") > 0) {
    try {
      return print_memory_account(config_file, assignments, backend, in.memory_gib, host_gib);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ringattn-plan: %s\n", e.what());
      return 2;
    }
  }
  if (app.count("--kv-heads") == 0) in.kv_heads = in.heads;
  if (full) in.causal = false;
  in.zigzag = layout != "contiguous";  // balanced: zigzag's chunks under a causal mask alone
  const std::int64_t parts = layout != "contiguous" ? 2 * std::int64_t{in.ranks} : in.ranks;
  if (in.heads % in.kv_heads != 0) {
    std::fprintf(stderr, "ringattn-plan: --kv-heads %lld does not divide --heads %lld\n",
                 (long long)in.kv_heads, (long long)in.heads);
    return 2;
  }
  if (in.seq % parts != 0) {
    std::fprintf(
        stderr,
        "ringattn-plan: --seq %lld is not a multiple of %lld (--layout %s over --ranks %d)\n",
        (long long)in.seq, (long long)parts, layout.c_str(), in.ranks);
    return 2;
  }
  try {
    const ringattn::RingPlan p = ringattn::plan_ring(in);
    std::printf("ring of %d, seq %lld (%lld tokens a rank), heads %lld/%lld, head_dim %lld, %s, %s\n",
                in.ranks, (long long)in.seq, (long long)p.tokens_per_rank, (long long)in.heads,
                (long long)in.kv_heads, (long long)in.head_dim, in.causal ? "causal" : "full", layout.c_str());
    std::printf("assumed: %.0f TFLOP/s attention, %.0f GB/s link, %.0f GiB a GPU\n\n", in.attention_tflops,
                in.link_gbytes_per_s, in.memory_gib);
    std::printf("%-9s %12s %12s %8s %22s\n", "per step", "compute ms", "transfer ms", "hidden", "hides from tokens/rank");
    std::printf("%-9s %12.3f %12.3f %8s %22.0f\n", "forward", p.forward_compute_ms, p.forward_transfer_ms,
                p.forward_hidden ? "yes" : "NO", p.forward_min_tokens_per_rank);
    std::printf("%-9s %12.3f %12.3f %8s %22.0f\n", "backward", p.backward_compute_ms, p.backward_transfer_ms,
                p.backward_hidden ? "yes" : "NO", p.backward_min_tokens_per_rank);
    std::printf("\nattention memory: %.0f bytes a local token; longest sequence that fits on %d GPUs: %lld\n",
                p.bytes_per_local_token, in.ranks, (long long)p.longest_seq);

    const std::vector<std::int64_t> starts =
        documents.empty() ? std::vector<std::int64_t>{} : ringattn::document_starts(documents, in.seq);
    ringattn::Mask mask;
    mask.causal = in.causal;
    mask.window_left = window_left;
    mask.window_right = window_right;
    mask.documents = {starts.data(), static_cast<std::int64_t>(starts.size()), 0};
    const ringattn::RingBalance balance = ringattn::ring_balance(
        ringattn::parse_sequence_layout(layout), in.ranks, in.seq, mask);
    std::printf("\nmask: %s, window_left %lld, window_right %lld, documents %s",
                in.causal ? "causal" : "full", (long long)window_left, (long long)window_right,
                documents.empty() ? "none" : documents.c_str());
    if (!documents.empty()) std::printf(" (%zu starts)", starts.size());
    std::printf("\nlayout: %s", balance.layout.c_str());
    std::printf("\nring steps: %d of %d (K/V hops: %d; the backward's dK/dV hops: %d)\n", balance.steps,
                in.ranks, balance.steps - 1, balance.steps > 1 ? in.ranks : 0);
    std::printf("visible pairs by rank, over the mean:");
    for (double pairs : balance.visible_pairs) std::printf(" %.3f", pairs / balance.mean);
    std::printf("\nimbalance (most loaded rank / mean): %.3f\n", balance.imbalance());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringattn-plan: %s\n", e.what());
    return 2;
  }
}
