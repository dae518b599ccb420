#!/usr/bin/env bash
# The tools' command lines are checked before any work and refused naming what is wrong: --help
# on any machine, an unknown flag, each kind of range an option takes, options that do not go
# together, an output file that cannot be written, sizes beyond the host's memory (a message, never
# "terminate called"); under mpiexec the message on every rank, and ranks started with different
# arguments (MPMD) stopping instead of waiting for each other.
#
#   cli_errors.sh CASE PROGRAM [MPIEXEC]
#
# CASE: bench, gradcheck, data, plan, demo, flash_check (one process; the MPI tools start MPI as
# a singleton), gradcheck.np2 or bench.np2 (two ranks under MPIEXEC). Every check asserts the exit
# status and the message; each command gets 30 s (timeout kills it, and mpiexec its ranks).
set -u

case_name=$1
program=$2
mpiexec=${3:-mpiexec}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'not a directory\n' > "$tmp/file"
printf 'keep\n' > "$tmp/existing.json"
printf 'some text for the tokenizer\n' > "$tmp/input.txt"
mkdir "$tmp/dir.train.h5"

checks=0
failures=0
output=""
status=0
command_text=""

# run COMMAND...: runs it (30 s at most), keeping its exit status and output (stdout and stderr).
run() {
  command_text="$*"
  output=$(timeout -k 5 30 "$@" 2>&1 < /dev/null)
  status=$?
}

fail() {
  failures=$((failures + 1))
  printf 'FAIL: %s\n  %s\n  exit status %s, output:\n%s\n' "$command_text" "$1" "$status" \
    "$(sed 's/^/    | /' <<< "$output")"
}

# expect STATUS TEXT...: the last command exited with STATUS ("nonzero": any but 0 and a
# time-out's 124 or 137), its output holds every TEXT (fixed strings) and no "terminate called".
expect() {
  local want=$1
  shift
  checks=$((checks + 1))
  if [[ $status == 124 || $status == 137 ]]; then
    fail "timed out after 30 s"
    return
  fi
  if [[ $want == nonzero && $status == 0 ]] || [[ $want != nonzero && $status != "$want" ]]; then
    fail "expected exit status $want"
    return
  fi
  if grep -Fq "terminate called" <<< "$output"; then
    fail "an uncaught exception (terminate called)"
    return
  fi
  local text
  for text in "$@"; do
    if ! grep -Fq -- "$text" <<< "$output"; then
      fail "expected the output to hold: $text"
      return
    fi
  done
}

# expect_on_ranks N TEXT: a line "rank R: ...TEXT..." for every rank R below N.
expect_on_ranks() {
  local ranks=$1 text=$2 rank
  checks=$((checks + 1))
  for ((rank = 0; rank < ranks; ++rank)); do
    if ! grep "^rank $rank: " <<< "$output" | grep -Fq -- "$text"; then
      fail "expected rank $rank to print: $text"
      return
    fi
  done
}

# expect_count N TEXT: TEXT on exactly N lines.
expect_count() {
  local want=$1 text=$2 count
  checks=$((checks + 1))
  count=$(grep -Fc -- "$text" <<< "$output")
  [[ $count == "$want" ]] || fail "expected $want lines with: $text (found $count)"
}

# expect_file PATH CONTENT ("absent": no such file): what the last command left at PATH.
expect_file() {
  checks=$((checks + 1))
  if [[ $2 == absent ]]; then
    [[ ! -e $1 ]] || fail "expected no file $1"
  elif [[ "$(cat "$1" 2> /dev/null)" != "$2" ]]; then
    fail "expected $1 to hold '$2'"
  fi
}

huge=1099511627776  # 2^40 tokens
mpi=("$mpiexec" --oversubscribe)

case $case_name in
  bench)
    run "$program" --help
    expect 0 "Usage:" "attention" "ring"
    run "$program" ring --help
    expect 0 "Usage:" "--seqlens"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" attention --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" ring --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" attention --seqlens 512,0
    expect 2 "--seqlens: got '512,0', expected comma-separated whole numbers from 1 to 2147483647"
    run "$program" attention --json /proc/nonexistent/bench.json
    expect 2 "--json '/proc/nonexistent/bench.json' cannot be written: No such file or directory"
    run "$program" ring --seqlens 4096,x
    expect 2 "--seqlens: got '4096,x', expected comma-separated whole numbers"
    run "$program" ring --heads 0
    expect 2 "--heads: got '0', expected a whole number >= 1"
    run "$program" ring --kv-heads 16,-4
    expect 2 "--kv-heads: got '16,-4', expected comma-separated whole numbers >= 1"
    run "$program" ring --repeats 0
    expect 2 "--repeats: got '0', expected a whole number from 1 to 2147483647"
    run "$program" ring --warmup -1
    expect 2 "--warmup: got '-1', expected a whole number from 0 to 2147483647"
    run "$program" ring --max-full-seq -5
    expect 2 "--max-full-seq: got '-5', expected a whole number >= 0"
    run "$program" ring --causal sometimes
    expect 2 "--causal: sometimes not in {both,on,off}"
    run "$program" ring --kv-heads 3
    expect 2 "--kv-heads 3 does not divide --heads 16"
    run "$program" ring --seqlens 1001
    expect 2 "--seqlens has 1001, not a multiple of 2 (zigzag over 1 ranks)"
    run "$program" ring --json "$tmp/file/bench.json"
    expect 2 "--json '$tmp/file/bench.json' cannot be written: Not a directory"
    ;;
  gradcheck)
    run "$program" --help
    expect 0 "Usage:" "--kv-heads"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" --kv-heads -1
    expect 2 "--kv-heads: got '-1', expected a whole number >= 1"
    run "$program" --time -3
    expect 2 "--time: got '-3', expected a whole number from 0 to 2147483647"
    run "$program" --seq 0
    expect 2 "--seq: got '0', expected a whole number >= 1"
    run "$program" --seq 99999999999999999999
    expect 2 "--seq: got '99999999999999999999', expected a whole number >= 1"
    run "$program" --seed -1
    expect 2 "--seed: got '-1', expected a whole number from 0 to 18446744073709551615"
    run "$program" --layout diagonal
    expect 2 "--layout: diagonal not in {zigzag,contiguous}"
    run "$program" --kv-heads 3
    expect 2 "--kv-heads 3 does not divide --heads 8"
    run "$program" --seq 17
    expect 2 "--seq 17 is not a multiple of 2 (--layout zigzag over 1 rank)"
    run "$program" --oracle gpu
    expect 2 "--oracle gpu needs --backend cuda"
    run "$program" --v-head-dim 0
    expect 2 "--v-head-dim: got '0', expected a whole number >= 1"
    run "$program" --backend cuda --dtype bf16 --seq 16 --head-dim 128 --v-head-dim 64
    expect 2 "--backend cuda: v has head_dim 64 but q and k have 128; the CUDA block takes one head_dim for q, k and v (32, 64, 96, 128, 192 or 256)"
    run "$program" --seq 16 --json /proc/nonexistent/gradcheck.json
    expect 2 "--json '/proc/nonexistent/gradcheck.json' cannot be written: No such file or directory"
    run "$program" --seq 16 --json "$tmp/file/gradcheck.json"
    expect 2 "--json '$tmp/file/gradcheck.json' cannot be written: Not a directory"
    # A size beyond the host's memory is refused naming it; the --json probe before it leaves an
    # existing file as it was and removes the file it created.
    run "$program" --seq $huge --json "$tmp/existing.json"
    expect 2 "--seq $huge --batch 1 --heads 8 --kv-heads 8 --head-dim 64 needs at least" \
      "GiB of host memory"
    expect_file "$tmp/existing.json" keep
    run "$program" --seq $huge --json "$tmp/new.json"
    expect 2 "--seq $huge"
    expect_file "$tmp/new.json" absent
    run "$program" --seq $huge --head-dim 192 --v-head-dim 128
    expect 2 "--head-dim 192 --v-head-dim 128 needs at least" "GiB of host memory"
    ;;
  data)
    run "$program" --help
    expect 0 "Usage:" "--val-fraction"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" --out "$tmp/out.h5"
    expect 2 "FILE is required"
    run "$program" --val-fraction 1 --out "$tmp/out.h5" "$tmp/input.txt"
    expect 2 "--val-fraction: got '1', expected a number >= 0 and < 1"
    run "$program" --val-fraction nan --out "$tmp/out.h5" "$tmp/input.txt"
    expect 2 "--val-fraction: got 'nan', expected a number >= 0 and < 1"
    run "$program" --val-fraction 0 --out "$tmp/file/out.h5" "$tmp/input.txt"
    expect 1 "--out '$tmp/file/out.h5': cannot create the directory '$tmp/file'"
    run "$program" --val-fraction 0 --out "$tmp/dir" "$tmp/input.txt"
    expect 1 "--out '$tmp/dir.train.h5' cannot be written: Is a directory"
    ;;
  plan)
    run "$program" --help
    expect 0 "Usage:" "--link-gbps"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" --ranks 0
    expect 2 "--ranks: got '0', expected a whole number from 1 to 16777216"
    run "$program" --head-dim -64
    expect 2 "--head-dim: got '-64', expected a whole number >= 1"
    run "$program" --tflops 0
    expect 2 "--tflops: got '0', expected a finite number > 0"
    run "$program" --link-gbps nan
    expect 2 "--link-gbps: got 'nan', expected a finite number > 0"
    run "$program" --memory-gib inf
    expect 2 "--memory-gib: got 'inf', expected a finite number > 0"
    run "$program" --element-bytes 3
    expect 2 "--element-bytes: 3 not in {2,4}"
    run "$program" --layout diagonal
    expect 2 "--layout: diagonal not in {zigzag,contiguous,balanced}"
    run "$program" --kv-heads 5
    expect 2 "--kv-heads 5 does not divide --heads 16"
    run "$program" --seq 1001
    expect 2 "--seq 1001 is not a multiple of 4 (--layout zigzag over --ranks 2)"
    # --config: the memory account of a training config, every component named, and the longest
    # seq_len for each GPU count on its own row (GPUs, seq_len, tokens a rank, peak GiB).
    configs="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/configs"
    run "$program" --config "$configs/long-2gpu.yaml" --memory-gib 139
    expect 0 "parameters (master weights)" "gradients" "AdamW moments (this rank's share)" \
      "weights in the activation dtype" "kept block inputs" "kept attention outputs and LSE" \
      "attention working set" "feed-forward arena (16384-token chunks)" \
      "residual gradients, final norm" "logits chunk" "ring workspace (its own)" \
      "cuBLASLt workspace" "KiB/token" "fixed MiB" \
      "predicted peak " " GiB for 1081344 tokens a rank" \
      "longest train.seq_len that fits, 139 GiB a GPU"
    for gpus in 1 2 4 8; do
      checks=$((checks + 1))
      grep -Eq "^ +$gpus +[1-9][0-9]* +[1-9][0-9]* +[0-9]+\.[0-9]+ +[0-9]+\.[0-9]+ +(on|off)$" \
        <<< "$output" ||
        fail "expected a row for $gpus GPUs: GPUs, seq_len, tokens a rank, peak GiB, host GiB, offload"
    done
    run "$program" --set train.seq_len=64
    expect 2 "--set requires --config"
    run "$program" --config "$configs/long-2gpu.yaml" --backend tpu
    expect 2 "--backend: tpu not in {cuda,cpu}"
    run "$program" --config "$configs/long-2gpu.yaml" --set train.mlp_chunk_tokens=-1
    expect 2 "train.mlp_chunk_tokens"
    run "$program" --config "$configs/long-2gpu.yaml" --set train.offload=maybe
    expect 2 "train.offload is 'maybe'; expected one of auto, on, off"
    run "$program" --host-memory-gib 10
    expect 2 "--host-memory-gib requires --config"
    run "$program" --config "$configs/long-2gpu.yaml" --host-memory-gib -1
    expect 2 "--host-memory-gib: got '-1', expected a finite number > 0"
    ;;
  demo)
    run "$program" --help
    expect 0 "Usage:" "--head-dim"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" --seq 0
    expect 2 "--seq: got '0', expected a whole number >= 1"
    run "$program" --seed -1
    expect 2 "--seed: got '-1', expected a whole number from 0 to 4294967295"
    run "$program" --kv-heads 3
    expect 2 "--kv-heads 3 does not divide --heads 8"
    run "$program" --seq $huge
    expect 2 "--seq $huge --heads 8 --kv-heads 2 --head-dim 64 needs at least" "GiB of host memory"
    ;;
  flash_check)
    run "$program" --help
    expect 0 "Usage:" "--max-len"
    run "$program" --bogus
    expect 2 "The following argument was not expected: --bogus"
    run "$program" --cases 0
    expect 2 "--cases: got '0', expected a whole number >= 1"
    run "$program" --first-case -1
    expect 2 "--first-case: got '-1', expected a whole number >= 0"
    run "$program" --max-len 2000000
    expect 2 "--max-len: got '2000000', expected a whole number from 1 to 1048576"
    run "$program" --seed -1
    expect 2 "--seed: got '-1', expected a whole number from 0 to 18446744073709551615"
    run "$program" --family volta
    expect 2 "--family: volta not in {both,hopper,sm80}"
    run "$program" --inject everything
    expect 2 "--inject: everything not in {none,"
    run "$program" --first-case 9223372036854775807
    expect 2 "--first-case 9223372036854775807 with --cases 200 counts past 9223372036854775807"
    run "$program" --json /proc/nonexistent/flash.json
    expect 2 "--json '/proc/nonexistent/flash.json' cannot be written: No such file or directory"
    ;;
  gradcheck.np2)
    run "${mpi[@]}" -np 2 "$program" --help
    expect 0 "Usage:"
    expect_count 1 "Usage:"
    run "${mpi[@]}" -np 2 "$program" --bogus
    expect nonzero
    expect_on_ranks 2 "ringattn-gradcheck: The following argument was not expected: --bogus"
    run "${mpi[@]}" -np 2 "$program" --kv-heads 3
    expect nonzero
    expect_on_ranks 2 "ringattn-gradcheck: --kv-heads 3 does not divide --heads 8"
    run "${mpi[@]}" -np 2 "$program" --seq 16 --json /proc/nonexistent/gradcheck.json
    expect nonzero
    expect_on_ranks 1 "--json '/proc/nonexistent/gradcheck.json' cannot be written: No such file or directory"
    expect_on_ranks 2 "--json '/proc/nonexistent/gradcheck.json' cannot be written"
    run "${mpi[@]}" -np 2 "$program" --seq $huge
    expect nonzero
    expect_on_ranks 2 "--seq $huge --batch 1 --heads 8 --kv-heads 8 --head-dim 64 needs at least"
    # MPMD: ranks given different arguments all say which, and all stop.
    run "${mpi[@]}" -np 1 "$program" --seq 16 --time 1 : -np 1 "$program" --seq 16 --time 2
    expect nonzero
    expect_on_ranks 2 "the ranks got different arguments: argument 4 (--time) is '1' on rank 0 but '2' on rank 1"
    run "${mpi[@]}" -np 1 "$program" --seq 16 : -np 1 "$program" --seq 16 --time -3
    expect nonzero
    expect_on_ranks 2 "the ranks got different arguments: argument 3 is absent on rank 0 but '--time' on rank 1"
    expect "nonzero" "rank 1: ringattn-gradcheck: --time: got '-3'"
    ;;
  bench.np2)
    run "${mpi[@]}" -np 2 "$program" ring --help
    expect 0 "Usage:"
    expect_count 1 "Usage:"
    run "${mpi[@]}" -np 2 "$program" ring --repeats 0
    expect nonzero
    expect_on_ranks 2 "ringattn-bench ring: --repeats: got '0', expected a whole number from 1 to 2147483647"
    run "${mpi[@]}" -np 2 "$program" ring --seqlens 1002
    expect nonzero
    expect_on_ranks 2 "ringattn-bench ring: --seqlens has 1002, not a multiple of 4 (zigzag over 2 ranks)"
    run "${mpi[@]}" -np 2 "$program" ring --json /proc/nonexistent/bench.json
    expect nonzero
    expect_on_ranks 2 "--json '/proc/nonexistent/bench.json' cannot be written: No such file or directory"
    run "${mpi[@]}" -np 1 "$program" ring --seqlens 4096 : -np 1 "$program" ring --seqlens 8192
    expect nonzero
    expect_on_ranks 2 "the ranks got different arguments: argument 3 (--seqlens) is '4096' on rank 0 but '8192' on rank 1"
    ;;
  *)
    echo "cli_errors.sh: unknown case '$case_name'" >&2
    exit 2
    ;;
esac

echo "cli_errors.sh $case_name: $((checks - failures)) of $checks checks passed"
[[ $failures == 0 ]]
