# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `cli` (sourced by tests/faults/run_case.sh): each program of the build
# (ringattn-gradcheck, -data, -plan, -demo, -flash-check, -bench, -train) refusing a bad command
# line before any work, naming the option, its value and what it takes: 0 where >= 1 is needed,
# negative, nan, out of the type's range, an unknown flag or value, a missing value, options that do
# not go together, an output that cannot be written. The usage errors exit 2 (the tools' rule;
# ringattn-train keeps CLI11's codes), errors found after parsing 1. Cases named *_np2 run two
# ranks under mpiexec, where each rank prints the message prefixed "rank R: ". These widen
# tests/tools/cli_errors.sh and repeat none of its checks.

define_case() {
  local gradcheck="$build/ringattn-gradcheck" plan="$build/ringattn-plan" demo="$build/ringattn-demo"
  local flash="$build/ringattn-flash-check" bench="$build/ringattn-bench" data="$build/ringattn-data"
  case $1 in
    # ---- ringattn-gradcheck ----
    gradcheck_batch_zero)
      command=("$gradcheck" --batch 0)
      expect_status=2
      expect=("ringattn-gradcheck: --batch: got '0', expected a whole number >= 1") ;;
    gradcheck_heads_negative)
      command=("$gradcheck" --heads -2)
      expect_status=2
      expect=("ringattn-gradcheck: --heads: got '-2', expected a whole number >= 1") ;;
    gradcheck_head_dim_nan)
      command=("$gradcheck" --head-dim nan)
      expect_status=2
      expect=("ringattn-gradcheck: --head-dim: got 'nan', expected a whole number >= 1") ;;
    gradcheck_seed_overflow)
      command=("$gradcheck" --seed 18446744073709551616)
      expect_status=2
      expect=("--seed: got '18446744073709551616', expected a whole number from 0 to 18446744073709551615") ;;
    gradcheck_dtype_unknown)
      command=("$gradcheck" --dtype f8)
      expect_status=2
      expect=("ringattn-gradcheck: --dtype: f8 not in {f32,f64,bf16,f16}") ;;
    gradcheck_backend_unknown)
      command=("$gradcheck" --backend tpu)
      expect_status=2
      expect=("ringattn-gradcheck: --backend: tpu not in {cpu,cuda}") ;;
    gradcheck_oracle_unknown)
      command=("$gradcheck" --oracle quantum)
      expect_status=2
      expect=("ringattn-gradcheck: --oracle: quantum not in {auto,fp64,gpu}") ;;
    gradcheck_cpu_bf16)  # conflicting: a device dtype on the CPU backend
      command=("$gradcheck" --dtype bf16)
      expect_status=2
      expect=("ringattn-gradcheck: --backend cpu: q has dtype bf16; host tensors run on the CPU block, which takes f32 or f64") ;;
    gradcheck_cuda_f32)  # conflicting: a host dtype on the CUDA backend (said before any GPU is asked)
      command=("$gradcheck" --backend cuda --dtype f32)
      expect_status=2
      expect=("ringattn-gradcheck: --backend cuda: q has dtype f32; device tensors run on the CUDA block, which takes bf16 or f16") ;;
    gradcheck_missing_value)
      command=("$gradcheck" --seq)
      expect_status=2
      expect=("ringattn-gradcheck: --seq: 1 required INT:POSITIVE missing") ;;
    gradcheck_positional)
      command=("$gradcheck" --seq 16 extra)
      expect_status=2
      expect=("ringattn-gradcheck: The following argument was not expected: extra") ;;
    gradcheck_json_directory)
      mkdir out.json
      command=("$gradcheck" --seq 16 --json out.json)
      expect_status=2
      expect=("ringattn-gradcheck: --json 'out.json' cannot be written: Is a directory") ;;
    gradcheck_head_dim_huge)  # a size beyond the host's memory, refused naming it
      command=("$gradcheck" --head-dim 99999999)
      expect_status=2
      expect=("--seq 4096 --batch 1 --heads 8 --kv-heads 8 --head-dim 99999999 needs at least"
              "GiB of host memory") ;;
    gradcheck_contiguous_np2)  # --layout contiguous over 2 ranks needs a multiple of 2
      command=("${np2[@]}" "$gradcheck" --seq 17 --layout contiguous)
      expect_count=2 expect_ranks=2
      expect=("ringattn-gradcheck: --seq 17 is not a multiple of 2 (--layout contiguous over 2 ranks)") ;;
    # ---- ringattn-plan ----
    plan_ranks_over)
      command=("$plan" --ranks 16777217)
      expect_status=2
      expect=("ringattn-plan: --ranks: got '16777217', expected a whole number from 1 to 16777216") ;;
    plan_seq_zero)
      command=("$plan" --seq 0)
      expect_status=2
      expect=("ringattn-plan: --seq: got '0', expected a whole number >= 1") ;;
    plan_tflops_negative)
      command=("$plan" --tflops -5)
      expect_status=2
      expect=("ringattn-plan: --tflops: got '-5', expected a finite number > 0") ;;
    plan_link_overflow)
      command=("$plan" --link-gbps 1e999)
      expect_status=2
      expect=("ringattn-plan: --link-gbps: got '1e999', expected a finite number > 0") ;;
    plan_contiguous_seq)
      command=("$plan" --seq 1000 --layout contiguous --ranks 3)
      expect_status=2
      expect=("ringattn-plan: --seq 1000 is not a multiple of 3 (--layout contiguous over --ranks 3)") ;;
    plan_element_bytes_text)  # a word for a number: named, with the set {2,4}
      command=("$plan" --element-bytes two)
      expect_status=2
      expect=("ringattn-plan: --element-bytes: two" "{2,4}") ;;
    plan_causal_and_full)  # both masks asked for: refused, not the last one winning
      command=("$plan" --causal --full)
      expect_status=2
      expect=("--causal" "--full") ;;
    plan_config_missing)  # --config names a file that is not there: the path, not a crash
      command=("$plan" --config missing.yaml)
      expect_status=2
      expect=("ringattn-plan: load_config: config file 'missing.yaml' does not exist") ;;
    plan_config_directory)
      mkdir conf.yaml
      command=("$plan" --config conf.yaml --memory-gib 80)
      expect_status=2
      expect=("ringattn-plan: load_config: config file 'conf.yaml' is a directory; expected a YAML file") ;;

    # ---- ringattn-demo ----
    demo_heads_zero)
      command=("$demo" --heads 0)
      expect_status=2
      expect=("ringattn-demo: --heads: got '0', expected a whole number >= 1") ;;
    demo_seed_overflow)
      command=("$demo" --seed 4294967296)
      expect_status=2
      expect=("ringattn-demo: --seed: got '4294967296', expected a whole number from 0 to 4294967295") ;;
    demo_kv_heads_divide)
      command=("$demo" --seq 3 --heads 4 --kv-heads 3)
      expect_status=2
      expect=("ringattn-demo: --kv-heads 3 does not divide --heads 4") ;;

    # ---- ringattn-flash-check ----
    flash_max_len_zero)
      command=("$flash" --max-len 0)
      expect_status=2
      expect=("ringattn-flash-check: --max-len: got '0', expected a whole number from 1 to 1048576") ;;
    flash_cases_negative)
      command=("$flash" --cases -1)
      expect_status=2
      expect=("ringattn-flash-check: --cases: got '-1', expected a whole number >= 1") ;;
    flash_json_directory)
      mkdir out.json
      command=("$flash" --json out.json)
      expect_status=2
      expect=("ringattn-flash-check: --json 'out.json' cannot be written: Is a directory") ;;

    # ---- ringattn-bench ----
    bench_no_subcommand)
      command=("$bench")
      expect_status=2
      expect=("ringattn-bench: A subcommand is required") ;;
    bench_unknown_subcommand)
      command=("$bench" bogus)
      expect_status=2
      expect=("ringattn-bench: The following argument was not expected: bogus") ;;
    bench_ring_head_dim_zero)
      command=("$bench" ring --head-dim 0)
      expect_status=2
      expect=("ringattn-bench ring: --head-dim: got '0', expected a whole number >= 1") ;;
    bench_ring_head_dim_80)  # a head dim the CUDA block has no kernel for (the default build's list)
      command=("$bench" ring --head-dim 80)
      expect_status=2
      expect=("ringattn-bench ring: --head-dim is 80; the CUDA block takes 32, 64, 96, 128, 192 or 256") ;;
    bench_ring_scratch)
      command=("$bench" ring --scratch shared)
      expect_status=2
      expect=("ringattn-bench ring: --scratch: shared not in {persistent,own}") ;;
    bench_ring_layout)
      command=("$bench" ring --layout diagonal)
      expect_status=2
      expect=("ringattn-bench ring: --layout: diagonal not in {zigzag,contiguous}") ;;
    bench_ring_seqlens_empty)
      command=("$bench" ring --seqlens "")
      expect_status=2
      expect=("ringattn-bench ring: --seqlens: got '', expected comma-separated whole numbers from 1 to 2147483647") ;;
    bench_ring_repeats_missing)
      command=("$bench" ring --repeats)
      expect_status=2
      expect=("ringattn-bench ring: --repeats: 1 required INT:in [1, 2147483647] missing") ;;
    bench_ring_json_directory)
      mkdir out.json
      command=("$bench" ring --json out.json)
      expect_status=2
      expect=("ringattn-bench ring: --json 'out.json' cannot be written: Is a directory") ;;
    bench_attention_head_dims_zero)
      command=("$bench" attention --head-dims 0)
      expect_status=2
      expect=("--head-dims: got '0', expected comma-separated head dims D or DQK:DV (whole numbers >= 1)") ;;
    bench_attention_head_dims_80)
      command=("$bench" attention --head-dims 80)
      expect_status=2
      expect=("ringattn-bench attention: --head-dims has 80: head_dim 80 is not supported; the CUDA block takes 32, 64, 96, 128, 192 or 256") ;;
    bench_attention_head_dims_pair)  # a d_qk:d_v pair without kernels
      command=("$bench" attention --head-dims 128:64)
      expect_status=2
      expect=("ringattn-bench attention: --head-dims has 128:64: v has head_dim 64 but q and k have 128; the CUDA block takes one head_dim for q, k and v") ;;
    bench_ring_heads_np2)
      command=("${np2[@]}" "$bench" ring --heads 0)
      expect_count=2 expect_ranks=2
      expect=("ringattn-bench ring: --heads: got '0', expected a whole number >= 1") ;;

    # ---- ringattn-data ----
    data_out_missing_value)
      printf 'some text\n' >input.txt
      command=("$data" input.txt --out)
      expect_status=2
      expect=("ringattn-data: --out: 1 required TEXT missing") ;;
    data_input_missing)
      printf 'some text\n' >input.txt
      command=("$data" --out ds input.txt missing.txt)
      expect_status=1
      expect=("ringattn-data: input 'missing.txt' does not exist")
      after=no_output_written ;;
    data_input_directory)
      mkdir texts
      command=("$data" --out ds texts)
      expect_status=1
      expect=("ringattn-data: input 'texts' is not a regular file") ;;
    data_input_empty)
      : >empty.txt
      command=("$data" --out ds empty.txt)
      expect_status=1
      expect=("ringattn-data: the inputs hold no training bytes (0 bytes in all)") ;;
    data_val_negative)
      printf 'some text\n' >input.txt
      command=("$data" --out ds --val-fraction -0.1 input.txt)
      expect_status=2
      expect=("ringattn-data: --val-fraction: got '-0.1', expected a number >= 0 and < 1") ;;
    data_val_empty_split)  # a fraction that gives no validation byte
      printf 'some text\n' >input.txt
      command=("$data" --out ds --val-fraction 0.01 input.txt)
      expect_status=1
      expect=("ringattn-data: the validation split is empty: 10 bytes at --val-fraction 0.01 give no byte per file")
      after=no_output_written ;;
    data_out_unwritable)
      printf 'some text\n' >input.txt
      command=("$data" --out /proc/out --val-fraction 0 input.txt)
      expect_status=1
      expect=("ringattn-data: --out '/proc/out.train.h5' cannot be written: No such file or directory") ;;
    data_out_empty)  # --out '' names no file: refused, not the hidden file .train.h5
      printf 'some text\n' >input.txt
      command=("$data" --out "" --val-fraction 0 input.txt)
      expect=("--out") ;;

    # ---- ringattn-train's command line ----
    train_unknown_flag)
      command=("$train" --bogus)
      expect=("The following argument was not expected: --bogus") ;;
    train_set_missing_value)
      command=("$train" --set)
      expect=("--set: 1 required KEY=VALUE missing") ;;
    train_two_configs)
      command=("$train" "$tiny_yaml" "$tiny_yaml")
      expect=("The following argument was not expected: $tiny_yaml") ;;
    train_unknown_flag_np2)  # an unknown flag on every rank: said once, prefixed
      command=("${np2[@]}" "$train" --bogus)
      expect=("The following argument was not expected: --bogus") ;;
    *) return 1 ;;
  esac
}

# After a refused conversion: no output file, not even a partial one.
no_output_written() {
  local left
  left=$(ls ds* 2>/dev/null)
  [[ -z $left ]] || failures+=("ringattn-data left $left behind")
}
