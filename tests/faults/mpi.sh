# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `mpi` (sourced by tests/faults/run_case.sh), all on two ranks under
# mpiexec:
#   mpmd_*  ranks launched MPMD-style (mpiexec -n 1 A : -n 1 B) with arguments that must agree and
#           do not (ringattn-train's config, ringattn-gradcheck's and ringattn-bench's command
#           lines, different programs): every rank stops, naming what differs; the trainer says it
#           once, the tools on every rank ("rank R: ...").
#   kill_*  a rank (or mpiexec) killed by SIGKILL mid-run: every process of the job must end
#           within after_kill_s (10 s) of the kill, with a nonzero status, and mpiexec names the
#           rank. (SIGTERM, which ringattn-train handles, is tests/tools/train_signals.sh's.)

define_case() {
  local short=("${tiny[@]}")
  local gradcheck="$build/ringattn-gradcheck" bench="$build/ringattn-bench"
  case $1 in
    # ---- ringattn-train, MPMD ----
    mpmd_d_model)
      command=("$mpiexec" -n 1 "$train" "${short[@]}" --set model.d_model=128
               : -n 1 "$train" "${short[@]}")
      expect=("Trainer: the ranks disagree: rank 0 has model.d_model 128 but rank 1 has model.d_model 64") ;;
    mpmd_layout)
      command=("$mpiexec" -n 1 "$train" "${short[@]}" --set parallel.layout=contiguous
               : -n 1 "$train" "${short[@]}")
      expect=("the ranks disagree: rank 0 has parallel.layout contiguous but rank 1 has parallel.layout zigzag") ;;
    mpmd_backend)  # auto is not resolved to cpu before the comparison: the texts differ
      command=("$mpiexec" -n 1 "$train" "${short[@]}" --set run.backend=auto
               : -n 1 "$train" "${short[@]}")
      expect=("the ranks disagree: rank 0 has run.backend auto but rank 1 has run.backend cpu") ;;
    mpmd_bad_set_rank1)  # a --set only rank 1 cannot take
      command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$train" "${short[@]}" --set train.lr=abc)
      expect=("ringattn-train: error: rank 1: apply_override: --set train.lr=abc: train.lr is 'abc'; expected a number") ;;
    mpmd_yaml_rank1)  # a config file only rank 1 cannot parse
      derive_config bad.yaml 's/^  seq_len: 256$/  seq_len: [256/'
      command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$train" bad.yaml)
      expect=("rank 1: load_config: bad.yaml:26:13: YAML syntax error: end of sequence flow not found") ;;
    mpmd_both_bad)  # each rank its own fault: both named, in rank order
      command=("$mpiexec" -n 1 "$train" "${short[@]}" --set train.lr=x
               : -n 1 "$train" "${short[@]}" --set train.beta1=y)
      expect=("rank 0: apply_override: --set train.lr=x: train.lr is 'x'; expected a number; rank 1: apply_override: --set train.beta1=y: train.beta1 is 'y'; expected a number") ;;
    mpmd_print_config_rank1)  # --print-config on one rank: the ranks disagree, said, never a hang
      command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$train" "${short[@]}" --print-config)
      hang_s=20
      expect=("--print-config") ;;
    mpmd_train_gradcheck)  # two programs in one launch: each names the other
      command=("$mpiexec" -n 1 "$train" "${short[@]}" : -n 1 "$gradcheck" --seq 16)
      expect=("ringattn-train: error: rank 1:" "ringattn-gradcheck")
      absent=("rank 1: ingattn-gradcheck") ;;

    # ---- the tools, MPMD: each rank says it ----
    mpmd_gradcheck_seq)
      command=("$mpiexec" -n 1 "$gradcheck" --seq 16 : -n 1 "$gradcheck" --seq 32)
      expect_count=2 expect_ranks=2
      expect=("ringattn-gradcheck: the ranks got different arguments: argument 2 (--seq) is '16' on rank 0 but '32' on rank 1") ;;
    mpmd_gradcheck_causal)  # a flag only rank 1 has
      command=("$mpiexec" -n 1 "$gradcheck" --seq 16 : -n 1 "$gradcheck" --seq 16 --causal)
      expect_count=2 expect_ranks=2
      expect=("the ranks got different arguments: argument 3 is absent on rank 0 but '--causal' on rank 1") ;;
    mpmd_gradcheck_dtype)
      command=("$mpiexec" -n 1 "$gradcheck" --seq 16 --dtype f64 : -n 1 "$gradcheck" --seq 16 --dtype f32)
      expect_count=2 expect_ranks=2
      expect=("the ranks got different arguments: argument 4 (--dtype) is 'f64' on rank 0 but 'f32' on rank 1") ;;
    mpmd_bench_heads)
      command=("$mpiexec" -n 1 "$bench" ring --heads 8 : -n 1 "$bench" ring --heads 16)
      expect_count=2 expect_ranks=2
      expect=("ringattn-bench ring: the ranks got different arguments: argument 3 (--heads) is '8' on rank 0 but '16' on rank 1") ;;
    mpmd_programs)  # two different programs in one job
      command=("$mpiexec" -n 1 "$gradcheck" --seq 16 : -n 1 "$bench" ring)
      expect_count=2 expect_ranks=2
      expect=("the ranks got different arguments: the program is 'ringattn-gradcheck' on rank 0 but 'ringattn-bench' on rank 1") ;;

    # ---- a rank killed mid-run ----
    kill_rank1_train)  # SIGKILL of rank 1 after step 2 of a 400-step run
      command=("${np2[@]}" "$train" "$tiny_yaml" --set train.log_every=1 --set train.eval_every=0
               --set run.dir="$work/run")
      during=(kill_rank_when "step 2/" 1 KILL)
      sends_signal 9
      expect_count=""
      expect=("mpiexec noticed that process rank 1 with PID" "exited on signal 9 (Killed)") ;;
    kill_rank0_train)  # SIGKILL of rank 0, the one that logs and writes checkpoints
      command=("${np2[@]}" "$train" "$tiny_yaml" --set train.log_every=1 --set train.eval_every=0
               --set run.dir="$work/run")
      during=(kill_rank_when "step 2/" 0 KILL)
      sends_signal 9
      expect_count=""
      expect=("mpiexec noticed that process rank 0 with PID" "exited on signal 9 (Killed)") ;;
    kill_launcher_train)  # SIGKILL of mpiexec: the orphaned ranks must end by themselves
      command=("${np2[@]}" "$train" "$tiny_yaml" --set train.log_every=1 --set train.eval_every=0
               --set run.dir="$work/run")
      during=(kill_rank_when "step 2/" launcher KILL)
      sends_signal 9
      expect_count=""  # mpiexec cannot say anything; the check is that no rank is left running
      expect=("step 2/") ;;
    kill_rank1_gradcheck)  # SIGKILL of rank 1 in the timing loop of ring forward+backward, 2 s in
      command=("${np2[@]}" "$gradcheck" --seq 256 --time 100000)
      during=(kill_rank_after 2 1 KILL)
      sends_signal 9
      expect_count=""
      expect=("mpiexec noticed that process rank 1 with PID" "exited on signal 9 (Killed)") ;;
    *) return 1 ;;
  esac
}
