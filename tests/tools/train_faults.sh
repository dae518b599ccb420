#!/usr/bin/env bash
# Faults that one rank or every rank of ringattn-train meets before step 1, on two CPU ranks: each
# case must end every rank with a nonzero status within 20 s and print the expected message the
# expected number of times (once where every rank met it alike).
#   tests/tools/train_faults.sh CASE RINGATTN_TRAIN MPIEXEC
# Exit 0: the case behaved; 1: it did not (what came is printed).
set -uo pipefail
case_name="$1" train="$2" mpiexec="$3"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$here/bench/launch_env.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/ringattn-faults.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
# The tiny CPU config, named, so that a GPU on the machine does not change the cases.
short=("$here/configs/tiny-cpu.yaml" --set train.steps=12 --set train.eval_every=0
       --set run.dir="$work/run")

expect_message=() expect_count=1
case "$case_name" in
  empty_config)  # a config file that sets nothing is refused, naming the file, said once
    echo "# only a comment" >empty.yaml
    command=("$mpiexec" -n 2 --oversubscribe "$train" empty.yaml)
    expect_message=("load_config: empty.yaml: the config sets no key" "(on every rank)") ;;
  mpmd_steps)  # ranks launched with different configs: every rank stops, naming the key
    command=("$mpiexec" -n 1 "$train" "${short[@]}" --set train.steps=5 : -n 1 "$train" "${short[@]}"
             --set train.steps=6 --set train.warmup_steps=2)
    expect_message=("the ranks disagree: " "rank 0 has train.steps 5 but rank 1 has train.steps 6") ;;
  mpmd_seed)  # a difference the ring would not notice: the replicas would drift apart
    command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$train" "${short[@]}" --set train.seed=7)
    expect_message=("rank 0 has train.seed 1234 but rank 1 has train.seed 7") ;;
  mpmd_missing_config)  # a config file only one rank lacks
    command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$train" missing.yaml)
    expect_message=("rank 1: load_config: config file 'missing.yaml' does not exist") ;;
  run_dir_blocked)  # a file where run.dir's parent should be: the filesystem error of rank 0
    touch blocker
    command=("$mpiexec" -n 2 --oversubscribe "$train" "${short[@]}" --set run.dir="$work/blocker/run")
    expect_message=("rank 0: filesystem error: cannot create directories" "blocker/run") ;;
  mpmd_data)  # each rank its own copy of the dataset, the copies different: named with both
    data="$(dirname "$train")/ringattn-data"
    # 40000 bytes each, different in their first byte.
    seq 1 10000 | head -c 40000 >a.txt
    { printf x; tail -c +2 a.txt; } >b.txt
    "$data" --out a --val-fraction 0 a.txt >/dev/null && "$data" --out b --val-fraction 0 b.txt >/dev/null ||
      { echo "FAIL: ringattn-data could not make the datasets"; exit 1; }
    hdf5=(--set data.source=hdf5 --set model.vocab_size=256)
    command=("$mpiexec" -n 1 "$train" "${short[@]}" "${hdf5[@]}" --set data.train_path=a.train.h5
             : -n 1 "$train" "${short[@]}" "${hdf5[@]}" --set data.train_path=b.train.h5)
    expect_message=("the ranks disagree: " "rank 0 has data.train_path 40000 tokens, vocab 256"
                    "but rank 1 has data.train_path 40000 tokens, vocab 256") ;;
  mpmd_resume)  # the same config, but each rank's run.resume (a relative path) names another
    # checkpoint (as node-local disks may hold): named with the steps of both
    mkdir -p at3 at2
    for steps in 3 2; do
      "$mpiexec" -n 2 --oversubscribe "$train" "${short[@]}" --set train.steps=$steps --set train.warmup_steps=0 \
        --set run.dir="$work/at$steps" >/dev/null 2>&1 || { echo "FAIL: no checkpoint of step $steps"; exit 1; }
      cp "at$steps/ckpt-$steps.h5" "at$steps/resume.h5"
    done
    command=("$mpiexec" -n 1 -wdir "$work/at3" "$train" "${short[@]}" --set run.resume=resume.h5
             : -n 1 -wdir "$work/at2" "$train" "${short[@]}" --set run.resume=resume.h5)
    expect_message=("the ranks disagree: " "rank 0 has resumed step 3 but rank 1 has resumed step 2") ;;
  invalid_everywhere)  # a config every rank finds invalid: said once
    command=("$mpiexec" -n 2 --oversubscribe "$train" "${short[@]}" --set train.warmup_steps=50)
    expect_message=("train.warmup_steps (50) is more than train.steps (12)" "(on every rank)") ;;
  *) echo "train_faults.sh: unknown case '$case_name'" >&2; exit 2 ;;
esac

start_ms=$(( $(date +%s%N) / 1000000 ))
timeout -k 5 60 "${command[@]}" >out.log 2>&1
status=$?
elapsed_ms=$(( $(date +%s%N) / 1000000 - start_ms ))
seconds="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
failed=0
if [[ $status -eq 0 ]]; then echo "FAIL: exit status 0; expected nonzero"; failed=1; fi
if [[ $status -eq 124 || $status -eq 137 ]]; then echo "FAIL: still running after 60 s (a hang)"; failed=1; fi
if (( elapsed_ms > 20000 )); then echo "FAIL: took ${seconds} s; expected under 20 s"; failed=1; fi
for part in "${expect_message[@]}"; do
  if ! grep -qF -- "$part" out.log; then echo "FAIL: the output lacks '$part'"; failed=1; fi
done
found=$(grep -cF -- "${expect_message[0]}" out.log)
if [[ $found -ne $expect_count ]]; then
  echo "FAIL: '${expect_message[0]}' printed $found times; expected $expect_count"; failed=1
fi
echo "case $case_name: exit $status in ${seconds} s"
if [[ $failed -ne 0 ]]; then echo "--- output:"; cat out.log; fi
exit $failed
