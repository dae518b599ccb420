#!/usr/bin/env bash
# A training run too long for one device call (a step at 2M tokens on one GPU takes longer than a
# call may run): started detached in one call, waited for in the next ones while the machine stays
# warm, its figures gathered at the end.
#
#   bench/long_context.sh start DIR [CONFIG] [STEPS]   starts ringattn-train CONFIG (default
#                                                      configs/long-1gpu.yaml) for STEPS steps
#                                                      (default 2) on the synthetic task, every
#                                                      step logged, into DIR; returns at once
#   bench/long_context.sh wait DIR SECONDS             waits up to SECONDS for it to end; prints
#                                                      the log's last lines; when it has ended,
#                                                      writes DIR/long_context.json
#
# DIR must outlive the call (e.g. /tmp/long on the device machine, not $OUT): copy DIR/run.log and
# DIR/long_context.json to $OUT after each wait. LONG_CONTEXT_SET adds `--set` assignments
# (space-separated key=value), e.g. "train.offload=on train.seq_len=1048576". RINGATTN_BUILD names
# another build than build-gpu/.
#
# long_context.json: the config and assignments, the steps run, each step's tokens/s, MFU and
# peak (the trainer's log), the peak the trainer predicted at startup, and the exit status.
set -uo pipefail
mode="${1:?usage: bench/long_context.sh start DIR [CONFIG] [STEPS] | wait DIR SECONDS}"
dir="${2:?usage: bench/long_context.sh start DIR [CONFIG] [STEPS] | wait DIR SECONDS}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${RINGATTN_BUILD:-build-gpu}"

case "$mode" in
  start)
    config="${3:-configs/long-1gpu.yaml}"
    steps="${4:-2}"
    mkdir -p "$dir"
    if [[ -f $dir/pid && ! -f $dir/status ]] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
      echo "long_context: a run is still going in $dir (pid $(cat "$dir/pid"))" >&2
      exit 2
    fi
    rm -f "$dir/status" "$dir/long_context.json"
    sets=()
    for assignment in ${LONG_CONTEXT_SET:-}; do sets+=(--set "$assignment"); done
    printf '%s\n' "$config" "${LONG_CONTEXT_SET:-}" >"$dir/what"
    # Detached from the call's session, so that it survives the call's end; the status file is
    # written when it ends, whatever ends it.
    setsid nohup bash -c '
      source bench/launch_env.sh
      "$@"; echo $? >"'"$dir"'/status"' _ \
      "$build/ringattn-train" "$config" --set data.source=retrieval --set parallel.cp=1 \
      --set train.steps="$steps" --set train.warmup_steps=1 --set train.log_every=1 \
      --set train.eval_every=0 --set train.checkpoint_every=0 --set run.dir="$dir/run" \
      --set run.backend=cuda "${sets[@]}" >"$dir/run.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    echo "long_context: started $config for $steps steps in $dir (pid $(cat "$dir/pid"))"
    ;;
  wait)
    seconds="${3:?usage: bench/long_context.sh wait DIR SECONDS}"
    [[ -f $dir/pid ]] || { echo "long_context: nothing started in $dir" >&2; exit 2; }
    deadline=$((SECONDS + seconds))
    while [[ ! -f $dir/status ]] && ((SECONDS < deadline)); do sleep 5; done
    grep -E 'predicted peak|^step|error|Error' "$dir/run.log" | tail -8
    if [[ ! -f $dir/status ]]; then
      echo "long_context: still running after ${seconds} s"
      exit 0
    fi
    python3 - "$dir" <<'PY'
import json, os, re, sys
d = sys.argv[1]
log = open(os.path.join(d, "run.log")).read()
config, sets = (open(os.path.join(d, "what")).read().split("\n") + ["", ""])[:2]
steps = [{"step": int(m[0]), "tokens_per_s": float(m[1]),
          "mfu": float(m[2]) / 100 if m[2] else None, "peak_mib": float(m[3])}
         for m in re.findall(
             r"^step (\d+)/\d+ .*?tokens/s (\S+)(?:\s+mfu (\S+)%)?\s+peak (\S+) MiB", log, re.M)]
predicted = re.search(r"predicted peak (\S+) GiB", log)
result = {"config": config, "set": sets, "status": int(open(os.path.join(d, "status")).read()),
          "revision": os.environ.get("RINGATTN_REVISION", ""), "steps": steps,
          "predicted_peak_gib": float(predicted.group(1)) if predicted else None}
json.dump(result, open(os.path.join(d, "long_context.json"), "w"), indent=1)
print(json.dumps(result))
PY
    ;;
  *)
    echo "long_context: unknown mode '$mode'; expected start or wait" >&2
    exit 2
    ;;
esac
