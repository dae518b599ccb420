#!/usr/bin/env bash
# Side-by-side throughput of ringattn-train builds on one GPU: bench/trainer.sh (without PyTorch)
# runs each shape on each build in turn, AB_ROUNDS times, so that the builds share the machine's
# state; each shape's median tokens/s per build is compared with the first build's.
#
#   bench/ab_trainer.sh OUTDIR BUILD [BUILD...]
#
#   BUILD          a configured build directory (e.g. bench/ab.sh's AB_KEEP/i/build); its
#                  ringattn-train is built first if it is missing. DIR+key=value[+key=value...]
#                  runs that build with those config overrides (one build, two settings:
#                  build-gpu build-gpu+train.recompute=true)
#   AB_ROUNDS      rounds (default 2)
#   TRAINER_SHAPES the shapes, seq x batch (default 8192x4,32768x1; 131072 and longer recompute)
#   TRAINER_STEPS  steps a run (default 10; bench/trainer.sh times the median after 3)
#
# Writes OUTDIR/ab_trainer.json (each build's tokens/s per round, medians and ratios to the first
# build; where bench/trainer.sh sampled the GPU's power, its energy a token the same way) and
# prints the ratios. The exit status is non-zero when a build or a run fails.
set -uo pipefail
out="${1:?usage: bench/ab_trainer.sh OUTDIR BUILD [BUILD...]}"
shift
[[ $# -ge 1 ]] || { echo "bench/ab_trainer.sh: name at least one BUILD directory" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
builds=() sets=()
for arg in "$@"; do
  dir="${arg%%+*}" set=""
  [[ $arg == *+* ]] && set="${arg#*+}"
  if [[ ! -f $dir/CMakeCache.txt ]]; then
    echo "bench/ab_trainer.sh: \"$dir\" is not a configured build directory (no CMakeCache.txt)" >&2
    exit 2
  fi
  builds+=("$(cd "$dir" && pwd)")
  sets+=("${set//+/ }")
done
rounds="${AB_ROUNDS:-2}"
export TRAINER_STEPS="${TRAINER_STEPS:-10}"
IFS=, read -r -a shapes <<<"${TRAINER_SHAPES:-8192x4,32768x1}"

for i in "${!builds[@]}"; do
  if [[ ! -x ${builds[$i]}/ringattn-train ]] &&
     ! cmake --build "${builds[$i]}" -j "$(nproc)" --target ringattn-train \
       >"$out/ab_trainer-build-$i.log" 2>&1; then
    echo "bench/ab_trainer.sh: building ringattn-train in ${builds[$i]} failed; see $out/ab_trainer-build-$i.log" >&2
    exit 1
  fi
done

# Runs of an earlier call into the same OUTDIR would join the medians.
rm -rf "${out:?}/ab_trainer-runs"
mkdir -p "$out/ab_trainer-runs"
for round in $(seq 1 "$rounds"); do
  for shape in "${shapes[@]}"; do
    for i in "${!builds[@]}"; do
      dir="$out/ab_trainer-runs/$i-$shape-$round"
      if ! RINGATTN_BUILD="${builds[$i]}" TRAINER_SET="${sets[$i]}" TRAINER_TORCH=0 TRAINER_SHAPES="$shape" \
          bash "$here/trainer.sh" "$dir" >"$dir.log" 2>&1; then
        echo "bench/ab_trainer.sh: the run of build $i at $shape, round $round, failed; see $dir.log" >&2
        exit 1
      fi
    done
  done
done

python3 - "$out" "$rounds" "$@" <<'PY'
import json, os, statistics, sys
out, rounds, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = os.path.join(out, "ab_trainer-runs")
rows, energy = {}, {}
for name in sorted(os.listdir(runs)):
    path = os.path.join(runs, name, "trainer.json")
    if not os.path.isfile(path):
        continue
    i, shape, _ = name.split("-")
    for r in json.load(open(path))["results"]:
        rows.setdefault(shape, [[] for _ in builds])[int(i)].append(r["tokens_per_s"])
        if r.get("power"):  # where bench/trainer.sh could sample the GPU's power
            energy.setdefault(shape, [[] for _ in builds])[int(i)].append(
                r["power"]["mj_per_token"])
table = []
for shape, per_build in rows.items():
    medians = [statistics.median(v) for v in per_build]
    row = {"shape": shape, "builds": [
        {"build": builds[i], "tokens_per_s": per_build[i], "median": medians[i],
         "ratio": medians[i] / medians[0]} for i in range(len(builds))]}
    # Energy a token (bench/power.py), each build's median, where every build has samples.
    if shape in energy and all(energy[shape]):
        mj = [statistics.median(v) for v in energy[shape]]
        for i, b in enumerate(row["builds"]):
            b.update(mj_per_token=energy[shape][i], mj_median=mj[i], mj_ratio=mj[i] / mj[0])
    table.append(row)
json.dump({"benchmark": "ringattn-train tokens/s, builds side by side (bench/trainer.sh)",
           "rounds": rounds, "rows": table}, open(os.path.join(out, "ab_trainer.json"), "w"),
          indent=1)
for row in table:
    print(f"{row['shape']:>10}  " + "  ".join(
        f"{b['median']:10.0f} ({b['ratio']:.3f})" for b in row["builds"]))
    if "mj_median" in row["builds"][0]:
        print(f"{'mJ/token':>10}  " + "  ".join(
            f"{b['mj_median']:10.3f} ({b['mj_ratio']:.3f})" for b in row["builds"]))
PY
