#!/usr/bin/env bash
# gpu-check part bench-retrieval_demo: the retrieval task learned through the ring, and its control.
# Usage: bench/retrieval_demo.sh OUTDIR
#
# configs/retrieval-16k.yaml on DEMO_RANKS ranks (cp = ranks, default 2), in two phases: DEMO_SHORT_STEPS
# steps at a DEMO_SHORT_SEQ-token context (default 600 at 256), then resumed at DEMO_SEQ (default
# 16384) up to DEMO_STEPS steps in all (default 2500); every run stops after DEMO_MINUTES minutes of
# wall time a phase at most (default 5; SIGTERM: a final checkpoint, a clean exit). Then the control,
# the same schedule with parallel.local_attention=true (each rank attends only to its own shard),
# unless DEMO_CONTROL=0. DEMO_SET adds --set overrides to every run ("train.lr=2e-3 ...");
# DEMO_BUILD names the build directory (default build-gpu).
#
# Writes OUTDIR/retrieval-ring.jsonl and retrieval-control.jsonl (metrics.jsonl of each run, both
# phases), retrieval-demo.json (the held-out accuracy at each evaluation, the training seconds and
# the settings) and, where matplotlib is present, PNGs from tools/plot_metrics.
set -uo pipefail
out="${1:?usage: bench/retrieval_demo.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/launch_env.sh
build="${DEMO_BUILD:-build-gpu}"
ranks="${DEMO_RANKS:-2}"
short_seq="${DEMO_SHORT_SEQ:-256}" short_steps="${DEMO_SHORT_STEPS:-600}"
seq="${DEMO_SEQ:-16384}" steps="${DEMO_STEPS:-2500}"
minutes="${DEMO_MINUTES:-5}"
read -r -a extra <<<"${DEMO_SET:-}"
sets=()
for kv in "${extra[@]}"; do sets+=(--set "$kv"); done
mkdir -p "$out"

train() {  # RUN_DIR LOCAL SEQ STEPS [--set run.resume=latest]
  local dir="$1" local_attention="$2" length="$3" total="$4"
  shift 4
  timeout -s TERM "$((minutes * 60))" mpiexec -n "$ranks" --oversubscribe "$build/ringattn-train" \
    configs/retrieval-16k.yaml --set parallel.cp="$ranks" --set train.seq_len="$length" \
    --set train.steps="$total" --set train.checkpoint_every=0 --set run.dir="$dir" \
    --set parallel.local_attention="$local_attention" "${sets[@]}" "$@"
}

run() {  # NAME LOCAL
  local name="$1" local_attention="$2" dir="/tmp/ringattn-retrieval-$1"
  rm -rf "$dir"
  echo "=== $name: $short_steps steps at $short_seq tokens, then to step $steps at $seq ($ranks ranks)"
  train "$dir" "$local_attention" "$short_seq" "$short_steps" 2>&1 | grep -E '^(ringattn|eval|resumed)'
  train "$dir" "$local_attention" "$seq" "$steps" --set run.resume=latest 2>&1 |
    grep -E '^(ringattn|eval|resumed)'
  cp "$dir/metrics.jsonl" "$out/retrieval-$name.jsonl"
  if python3 -c 'import matplotlib' 2>/dev/null; then
    tools/plot_metrics "$dir" --out "$out/retrieval-$name.png" >/dev/null 2>&1 || true
  fi
}

run ring false
[[ "${DEMO_CONTROL:-1}" == 1 ]] && run control true

python3 - "$out" "$short_seq" "$short_steps" "$seq" "$steps" "$ranks" "${DEMO_SET:-}" <<'EOF'
import json, os, sys
out, short_seq, short_steps, seq, steps, ranks, extra = sys.argv[1:8]
result = {"config": "configs/retrieval-16k.yaml", "ranks": int(ranks),
          "phases": [{"seq_len": int(short_seq), "until_step": int(short_steps)},
                     {"seq_len": int(seq), "until_step": int(steps)}],
          "overrides": extra, "runs": {}}
for name in ("ring", "control"):
    path = os.path.join(out, f"retrieval-{name}.jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(line) for line in open(path)]
    steps_rows = [r for r in rows if "seconds" in r]
    evals = [{"step": r["step"], "accuracy": r.get("eval_accuracy"), "loss": r.get("eval_loss")}
             for r in rows if "eval_loss" in r]
    seconds = sum(r["seconds"] for r in steps_rows)
    result["runs"][name] = {"steps": len(steps_rows), "training_seconds": seconds,
                            "final_accuracy": evals[-1]["accuracy"] if evals else None,
                            "best_accuracy": max((e["accuracy"] or 0 for e in evals), default=None),
                            "evaluations": evals}
    print(f"{name:>8}: {len(steps_rows)} steps, {seconds / 60:.1f} min of training, held-out "
          f"accuracy {result['runs'][name]['final_accuracy']}")
json.dump(result, open(os.path.join(out, "retrieval-demo.json"), "w"), indent=1)
EOF
