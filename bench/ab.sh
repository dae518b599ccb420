#!/usr/bin/env bash
# Side-by-side timing of the local block's builds on one GPU: each REV is built in a directory of
# its own, then `ringattn-bench attention` runs over the builds in turn, AB_ROUNDS times, so that
# the builds share the machine's state; each row's mean TFLOP/s is compared with the first REV's.
# A REV is "tree" (the working tree as it stands, uncommitted changes included), FILE.patch (the
# working tree with that patch applied, e.g. `git diff HEAD BRANCH > x.patch` where the machine
# that times has no BRANCH) or a git revision (a commit of the timing machine's own git, which may
# be behind the tree that was sent there).
#
#   bench/ab.sh OUTDIR REV [REV...]
#
#   AB_ROUNDS     rounds (default 3)
#   AB_SEQLENS    ringattn-bench's --seqlens (default 8192,32768)
#   AB_HEAD_DIMS  ringattn-bench's --head-dims (default 128)
#   AB_BUILD_HEAD_DIMS  the head dims each REV builds kernels for (RINGATTN_CUDA_HEAD_DIMS, comma-
#                 separated, e.g. 32,96: a fraction of the build time), default every one; it
#                 must hold AB_HEAD_DIMS
#   AB_TESTS      a ctest regex run afterwards on the build of each REV after the first (its tests
#                 are built too), e.g. '^kernels\.flash$'
#   AB_KEEP       a directory (empty or absent) to build in and keep: REV i's build is then
#                 AB_KEEP/i/build, e.g. for bench/trainer.sh's RINGATTN_BUILD after the A/B
#
# Writes OUTDIR/ab-<i>-<round>.json (ringattn-bench's rows, REV number i from 0) and
# OUTDIR/ab.json (the revisions, each row's TFLOP/s per round, means and ratios to REV 0), and
# prints the ratios. The exit status is non-zero when a build, a timing run or a test fails.
set -uo pipefail
out="${1:?usage: bench/ab.sh OUTDIR REV [REV...]}"
shift
[[ $# -ge 1 ]] || { echo "bench/ab.sh: name at least one REV (a git revision or \"tree\")" >&2; exit 2; }
revs=("$@")
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
mkdir -p "$out"
rounds="${AB_ROUNDS:-3}"
if [[ -n "${AB_KEEP:-}" ]]; then
  if [[ -e $AB_KEEP && -n "$(ls -A "$AB_KEEP" 2>/dev/null)" ]]; then
    echo "bench/ab.sh: AB_KEEP \"$AB_KEEP\" is not empty; expected an empty or absent directory" >&2
    exit 2
  fi
  mkdir -p "$AB_KEEP" || exit 2
  work="$(cd "$AB_KEEP" && pwd)"
else
  work="$(mktemp -d "${TMPDIR:-/tmp}/ringattn-ab.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
fi
jobs=$(( $(nproc) / ${#revs[@]} ))
[[ $jobs -ge 1 ]] || jobs=1

for i in "${!revs[@]}"; do
  rev="${revs[$i]}"
  if [[ $rev == *.patch ]]; then
    if [[ ! -f $rev ]]; then
      echo "bench/ab.sh: REV \"$rev\" names a patch file that does not exist" >&2
      exit 2
    fi
    revs[$i]="$(cd "$(dirname "$rev")" && pwd)/$(basename "$rev")"
  elif [[ $rev != tree ]] && ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "bench/ab.sh: REV \"$rev\" is neither \"tree\", a FILE.patch nor a git revision" >&2
    exit 2
  fi
done

build() {  # build REV-number REV
  local i="$1" rev="$2" dir="$work/$1" targets=(ringattn-bench)
  mkdir -p "$dir"
  if [[ $rev == tree || $rev == *.patch ]]; then
    # Tracked and untracked files that git does not ignore (no build or run directories).
    git ls-files -z -co --exclude-standard |
      tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$dir"
    if [[ $rev == *.patch ]] && ! (cd "$dir" && git apply "$rev") >"$out/ab-build-$i.log" 2>&1; then
      echo "bench/ab.sh: $rev does not apply to the working tree; see $out/ab-build-$i.log" >&2
      return 1
    fi
  else
    git archive "$rev" | tar -xf - -C "$dir"
  fi
  [[ $i -gt 0 && -n "${AB_TESTS:-}" ]] && targets=(all)
  local head_dims=()
  [[ -n "${AB_BUILD_HEAD_DIMS:-}" ]] && head_dims=("-DRINGATTN_CUDA_HEAD_DIMS=${AB_BUILD_HEAD_DIMS//,/;}")
  cmake -S "$dir" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGATTN_CUDA=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=${RINGATTN_GPU_ARCH:-90a}" "${head_dims[@]}" \
    >"$out/ab-build-$i.log" 2>&1 &&
    cmake --build "$dir/build" -j "$jobs" --target "${targets[@]}" >>"$out/ab-build-$i.log" 2>&1
}

start=$SECONDS
pids=()
for i in "${!revs[@]}"; do
  build "$i" "${revs[$i]}" &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "bench/ab.sh: the build of ${revs[$i]} failed; see $out/ab-build-$i.log" >&2
    failed=1
  fi
done
[[ $failed == 0 ]] || exit 1
echo "ab: ${#revs[@]} builds in $((SECONDS - start)) s"

for round in $(seq 1 "$rounds"); do
  for i in "${!revs[@]}"; do
    if ! "$work/$i/build/ringattn-bench" attention --seqlens "${AB_SEQLENS:-8192,32768}" \
        --head-dims "${AB_HEAD_DIMS:-128}" --json "$out/ab-$i-$round.json" \
        >"$out/ab-run-$i-$round.log" 2>&1; then
      echo "bench/ab.sh: ringattn-bench failed for ${revs[$i]}, round $round; see $out/ab-run-$i-$round.log" >&2
      exit 1
    fi
  done
done

if ! python3 - "$out" "$rounds" "${revs[@]}" <<'PY'
import json, subprocess, sys
out, rounds, revs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def commit(rev):
    if rev == "tree":
        return "working tree"
    if rev.endswith(".patch"):
        return f"working tree + {rev.rsplit('/', 1)[-1]}"
    return subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True,
                          text=True).stdout.strip()
def key(row):
    return (row["head_dim"], row["causal"], row["seq"], row["batch"], row["heads"])
runs = [[json.load(open(f"{out}/ab-{i}-{r}.json"))["rows"] for r in range(1, rounds + 1)]
        for i in range(len(revs))]
rows = []
for row in runs[0][0]:
    k = key(row)
    entry = {"head_dim": k[0], "causal": k[1], "seq": k[2], "batch": k[3], "heads": k[4]}
    for phase in ("forward", "backward"):
        per_rev = []
        for i in range(len(revs)):
            values = [next(x for x in runs[i][r] if key(x) == k)[f"{phase}_tflops"]
                      for r in range(rounds)]
            per_rev.append({"rev": revs[i], "tflops": values, "mean": sum(values) / rounds})
        for item in per_rev:
            item["ratio"] = item["mean"] / per_rev[0]["mean"]
        entry[phase] = per_rev
    rows.append(entry)
json.dump({"benchmark": "ringattn-bench attention, builds side by side", "revisions": revs,
           "commits": [commit(r) for r in revs], "rounds": rounds, "rows": rows},
          open(f"{out}/ab.json", "w"), indent=1)
print(f"{'d':>4} {'mask':>6} {'seq':>7}  " +
      "  ".join(f"{'bwd ' + r.rsplit('/', 1)[-1][:10]:>16}" for r in revs) + "   " +
      "  ".join(f"{'fwd ' + r.rsplit('/', 1)[-1][:10]:>16}" for r in revs))
for e in rows:
    cells = []
    for phase in ("backward", "forward"):
        cells.append("  ".join(f"{x['mean']:7.1f} ({x['ratio']:.3f})" for x in e[phase]))
    print(f"{e['head_dim']:>4} {'causal' if e['causal'] else 'none':>6} {e['seq']:>7}  " +
          "   ".join(cells))
PY
then
  exit 1
fi

if [[ -n "${AB_TESTS:-}" ]]; then
  for i in "${!revs[@]}"; do
    [[ $i -gt 0 ]] || continue
    if ! ctest --test-dir "$work/$i/build" -R "$AB_TESTS" --output-on-failure \
        >"$out/ab-tests-$i.log" 2>&1; then
      echo "bench/ab.sh: tests '$AB_TESTS' failed for ${revs[$i]}; see $out/ab-tests-$i.log" >&2
      failed=1
    fi
    grep -E 'tests passed|tests failed' "$out/ab-tests-$i.log" | sed "s|^|ab: ${revs[$i]}: |"
  done
fi
exit $failed
