# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `checkpoint` (sourced by tests/faults/run_case.sh): ringattn-train resuming
# (run.resume) from checkpoints it must refuse, naming the file and what is wrong with it, and
# failing to write one. Each case first makes a real checkpoint, ckpt/ckpt-1.h5, by a one-step quick
# run on one rank (make_checkpoint), then breaks it (truncates it, flips a byte, zeroes its
# superblock) or makes one of another model shape, and resumes on one rank or, for *_np2, on two
# (the message once, "(on every rank)", or naming rank 1 where rank 1 alone reads a broken copy).

define_case() {
  local resume=("$train" "${quick[@]}" --set train.steps=2 --set run.dir=resumed)
  case $1 in
    truncated_half)
      make_checkpoint ckpt
      truncate -s $(($(stat -c %s ckpt/ckpt-1.h5) / 2)) ckpt/ckpt-1.h5
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("load_checkpoint: checkpoint 'ckpt/ckpt-1.h5' is corrupt or truncated: HDF5 cannot open it") ;;
    bit_flip)  # one byte in the middle of the file: inside a tensor's data
      make_checkpoint ckpt
      flip_byte ckpt/ckpt-1.h5 $(($(stat -c %s ckpt/ckpt-1.h5) / 2))
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("load_checkpoint: checkpoint 'ckpt/ckpt-1.h5' is corrupt: its tensor '" "' does not match its checksum") ;;
    zeroed_superblock)
      make_checkpoint ckpt
      dd if=/dev/zero of=ckpt/ckpt-1.h5 bs=512 count=1 conv=notrunc status=none
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("checkpoint 'ckpt/ckpt-1.h5' is not an HDF5 file (" "bytes without the HDF5 signature)") ;;
    not_a_checkpoint)  # an HDF5 file of ringattn-data's
      text_dataset text 4000
      command=("${resume[@]}" --set run.resume=text.train.h5)
      expect=("checkpoint 'text.train.h5' is not a ringattn checkpoint (no attribute format = \"ringattn-checkpoint\")") ;;
    missing_path)
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-9.h5)
      expect=("resolve_resume: run.resume is 'ckpt/ckpt-9.h5', which is not a checkpoint file (expected \"\", \"latest\" or the path of a ckpt-<step>.h5)") ;;
    directory_path)
      mkdir -p ckpt/ckpt-1.h5
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("run.resume is 'ckpt/ckpt-1.h5', which is not a checkpoint file") ;;
    latest_corrupt)  # "latest" picks the newest, which is broken: it is named
      make_checkpoint resumed
      cp resumed/ckpt-1.h5 resumed/ckpt-7.h5
      truncate -s 1000 resumed/ckpt-7.h5
      command=("${resume[@]}" --set train.steps=9 --set run.resume=latest)
      expect=("checkpoint 'resumed/ckpt-7.h5' is corrupt or truncated") ;;
    other_d_model)
      make_checkpoint ckpt --set model.d_model=32
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("checkpoint 'ckpt/ckpt-1.h5' has tensor 'tok_embedding' of shape [256, 32]; expected [256, 64]") ;;
    other_kv_heads)
      make_checkpoint ckpt
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5 --set model.n_kv_heads=4)
      expect=("checkpoint 'ckpt/ckpt-1.h5' has tensor 'layers.0.wqkv' of shape [128, 64]; expected [192, 64]") ;;
    more_layers)  # the checkpoint has a layer the model lacks
      make_checkpoint ckpt --set model.n_layers=3
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("checkpoint 'ckpt/ckpt-1.h5' has tensor 'adam_m.layers.2.attn_norm', which the model does not"
              "a checkpoint of a different model?") ;;
    fewer_layers)
      make_checkpoint ckpt --set model.n_layers=1
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("checkpoint 'ckpt/ckpt-1.h5' has no tensor 'layers.1.attn_norm'") ;;
    untied_embeddings)
      make_checkpoint ckpt --set model.tied_embeddings=false
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-1.h5)
      expect=("checkpoint 'ckpt/ckpt-1.h5' has tensor 'adam_m.lm_head', which the model does not") ;;
    write_blocked)  # the final checkpoint's name is taken by a directory
      mkdir -p blocked/ckpt-2.h5
      command=("$train" "${quick[@]}" --set train.steps=2 --set run.dir=blocked)
      expect=("Trainer::save_checkpoint: publish_file: cannot rename 'blocked/ckpt-2.h5.tmp' to 'blocked/ckpt-2.h5': Is a directory") ;;
    write_test_blocked)  # the checkpoint write test's directory is a file
      mkdir blocked
      touch blocked/.checkpoint-write-test
      command=("$train" "${quick[@]}" --set train.steps=2 --set run.dir=blocked)
      expect=("save_checkpoint: cannot create directory 'blocked/.checkpoint-write-test': Not a directory") ;;
    past_the_end)  # a checkpoint of step 5 resumed into 2 steps: refused, naming both
      make_checkpoint ckpt --set train.steps=5
      command=("${resume[@]}" --set run.resume=ckpt/ckpt-5.h5)
      expect=("ckpt/ckpt-5.h5" "train.steps") ;;

    # ---- two ranks ----
    bit_flip_np2)
      make_checkpoint ckpt
      flip_byte ckpt/ckpt-1.h5 $(($(stat -c %s ckpt/ckpt-1.h5) / 2))
      command=("${np2[@]}" "$train" "${quick[@]}" --set parallel.cp=2 --set train.steps=2
               --set run.dir=resumed --set run.resume=ckpt/ckpt-1.h5)
      expect=("' does not match its checksum (on every rank)" "checkpoint 'ckpt/ckpt-1.h5' is corrupt: its tensor '") ;;
    copy_rank1_np2)  # rank 1 resumes from its own, broken copy (mpiexec -wdir)
      mkdir rank0 rank1
      make_checkpoint ckpt
      cp ckpt/ckpt-1.h5 rank0/ckpt.h5
      cp ckpt/ckpt-1.h5 rank1/ckpt.h5
      flip_byte rank1/ckpt.h5 $(($(stat -c %s rank1/ckpt.h5) / 2))
      local args=("$train" "${quick[@]}" --set parallel.cp=2 --set train.steps=2
                  --set run.dir="$work/resumed" --set run.resume=ckpt.h5)
      command=("$mpiexec" -n 1 -wdir rank0 "${args[@]}" : -n 1 -wdir rank1 "${args[@]}")
      expect=("Trainer: rank 1: load_checkpoint: checkpoint 'ckpt.h5' is corrupt: its tensor '") ;;
    resume_differs_np2)  # the ranks name different checkpoints
      make_checkpoint ckpt
      cp ckpt/ckpt-1.h5 copy.h5
      command=("$mpiexec" -n 1 "$train" "${quick[@]}" --set parallel.cp=2 --set train.steps=2
               --set run.dir=resumed --set run.resume=ckpt/ckpt-1.h5
               : -n 1 "$train" "${quick[@]}" --set parallel.cp=2 --set train.steps=2
               --set run.dir=resumed --set run.resume=copy.h5)
      expect=("the ranks disagree: rank 0 has run.resume ckpt/ckpt-1.h5 but rank 1 has run.resume copy.h5") ;;
    *) return 1 ;;
  esac
}
