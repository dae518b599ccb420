#!/usr/bin/env bash
# gpu-check part bench-memory_account: the trainer's memory account (the peak it predicts at
# startup) against the peak it measures (cudaMemGetInfo, the step logs' "peak"), and what the
# feed-forward chunks and the offload of the blocks' inputs cost and save, for the 188M shape of
# configs/long-2gpu.yaml on one GPU (cp = 1, recompute with the attention, synthetic tokens).
# Usage: bench/memory_account.sh OUTDIR
#
# MEMORY_ACCOUNT_CASES lists the runs as SEQ:MLP_CHUNK:STEPS[:OFFLOAD] (MLP_CHUNK 0: automatic,
# all: the whole local sequence, the untiled block; OFFLOAD on, off or auto, default auto);
# default 131072:all:4:off 131072:0:4:off 131072:0:4:on 524288:0:1:off.
# A step at 1M tokens takes minutes on one H200 (attention is quadratic in the length): add
# 1048576:0:1 where the time allows. RINGATTN_BUILD names another build than build-gpu/.
#
# Writes OUTDIR/memory_account.json: per run the predicted and measured peak (MiB), their ratio,
# tokens/s (median of the steps after the first) and MFU. The predicted peak is the trainer's
# (with the device memory in use before the model, measured); cudaMemGetInfo counts the pool
# that cudaMallocAsync keeps as well.
set -uo pipefail
out="${1:?usage: bench/memory_account.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/launch_env.sh
build="${RINGATTN_BUILD:-build-gpu}"
runs="$out/memory-account-runs"
mkdir -p "$runs"
status=0
read -r -a cases <<<"${MEMORY_ACCOUNT_CASES:-131072:all:4:off 131072:0:4:off 131072:0:4:on 524288:0:1:off}"
for c in "${cases[@]}"; do
  IFS=: read -r seq chunk steps offload <<<"$c"
  offload="${offload:-auto}"
  [[ $chunk == all ]] && chunk_value="$seq" || chunk_value="$chunk"
  name="seq${seq}-chunk${chunk}-offload${offload}"
  echo "=== ringattn-train $name ($steps steps)"
  rm -rf "${runs:?}/$name"
  timeout 590 "$build/ringattn-train" configs/long-2gpu.yaml \
    --set data.source=retrieval --set parallel.cp=1 --set train.seq_len="$seq" \
    --set train.mlp_chunk_tokens="$chunk_value" --set train.offload="$offload" \
    --set train.steps="$steps" \
    --set train.warmup_steps=1 --set train.log_every=1 --set train.eval_every=0 \
    --set train.checkpoint_every=0 --set run.dir="$runs/$name" --set run.backend=cuda \
    >"$runs/$name.log" 2>&1 || { status=1; tail -5 "$runs/$name.log"; }
  grep -iE 'predicted peak|^step' "$runs/$name.log" | tail -3
  rm -f "$runs/$name"/ckpt-*.h5
done

python3 - "$runs" "$out/memory_account.json" <<'PY' || status=1
import datetime, json, os, re, statistics, subprocess, sys
runs, out_path = sys.argv[1], sys.argv[2]
result = {"date": datetime.date.today().isoformat(),
          "revision": os.environ.get("RINGATTN_REVISION") or subprocess.run(
              ["tools/revision.sh"], capture_output=True, text=True).stdout.strip(),
          "device": subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                    "--format=csv,noheader"], capture_output=True,
                                   text=True).stdout.strip(),
          "config": "configs/long-2gpu.yaml at cp 1 (188M, recompute with attention), synthetic",
          "runs": []}
for name in sorted(os.listdir(runs)):
    log = os.path.join(runs, name + ".log")
    metrics = os.path.join(runs, name, "metrics.jsonl")
    if not name.startswith("seq") or not os.path.isfile(metrics):
        continue
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    text = open(log).read() if os.path.isfile(log) else ""
    m = re.search(r"predicted peak\D*([0-9.]+) GiB", text)
    predicted_mib = float(m.group(1)) * 1024 if m else None
    measured_mib = max(r["peak_memory_mib"] for r in rows)
    later = [r for r in rows if r["step"] > 1] or rows
    run = {"name": name, "steps": len(rows), "measured_peak_mib": measured_mib,
           "predicted_peak_mib": predicted_mib,
           "predicted_over_measured": predicted_mib / measured_mib if predicted_mib else None,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
           "mfu": statistics.median(r["mfu"] for r in later)}
    result["runs"].append(run)
    print(f"{name}: measured {measured_mib:.0f} MiB, predicted "
          f"{predicted_mib or float('nan'):.0f} MiB, {run['tokens_per_s']:.0f} tokens/s, "
          f"mfu {100 * run['mfu']:.1f}%")
json.dump(result, open(out_path, "w"), indent=1)
print("wrote", out_path)
PY
exit $status
