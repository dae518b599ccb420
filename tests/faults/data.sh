# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `data` (sourced by tests/faults/run_case.sh): ringattn-train on HDF5 token
# datasets (data.source hdf5; train/token_dataset.cpp) that it must refuse, naming the file and what
# is wrong with it. The datasets are made in the case's directory by ringattn-data (text_dataset) or,
# for the variants ringattn-data cannot write, by tests/faults/make_tokens.c (make_tokens). Cases on
# one rank run the quick run (16 tokens a sequence); *_np2 cases run two ranks, where a fault of
# every rank is said once, "(on every rank)", and a fault of one rank alone names it:
#   token_rank1_np2    each rank reads its own copy (mpiexec -wdir); rank 1's alone has a token >=
#                      vocab_size, which the identity check (every token, before step 1) finds.
#   copy_rank1_np2     each rank reads its own copy (mpiexec -wdir): rank 1's is broken.

define_case() {
  local hdf5=(--set data.source=hdf5 --set train.steps=2 --set train.warmup_steps=0)
  case $1 in
    missing_file)
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=missing.h5)
      expect=("TokenDataset: token dataset 'missing.h5' does not exist") ;;
    directory)
      mkdir tokens.h5
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=tokens.h5)
      expect=("token dataset 'tokens.h5' is a directory; expected an HDF5 file") ;;
    not_hdf5)
      printf 'plain text, not HDF5\n' >text.h5
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=text.h5)
      expect=("token dataset 'text.h5' is not an HDF5 file (21 bytes without the HDF5 signature)") ;;
    truncated)  # ringattn-data's file cut at 1000 bytes
      text_dataset text 4000
      head -c 1000 text.train.h5 >cut.h5
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=cut.h5)
      expect=("token dataset 'cut.h5' is corrupt or truncated: HDF5 cannot open it") ;;
    wrong_name)
      make_tokens named.h5 100 name=tokenz
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=named.h5)
      expect=("token dataset 'named.h5': no dataset 'tokens' (expected a 1-D uint16 or uint32 array of token ids)") ;;
    tokens_group)
      make_tokens group.h5 100 group=1
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=group.h5)
      expect=("token dataset 'group.h5': 'tokens' is not a dataset") ;;
    dtype_float32)
      make_tokens float.h5 100 type=float32
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=float.h5)
      expect=("token dataset 'float.h5': 'tokens' has type float32; expected uint16 or uint32") ;;
    dtype_uint8)
      make_tokens bytes.h5 100 type=uint8
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=bytes.h5)
      expect=("token dataset 'bytes.h5': 'tokens' has type uint8; expected uint16 or uint32") ;;
    dtype_int32)
      make_tokens signed.h5 100 type=int32
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=signed.h5)
      expect=("token dataset 'signed.h5': 'tokens' has type int32; expected uint16 or uint32") ;;
    two_dims)
      make_tokens matrix.h5 100 dims=2
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=matrix.h5)
      expect=("token dataset 'matrix.h5': 'tokens' has 2 dimensions [2, 50]; expected 1") ;;
    no_vocab)
      make_tokens novocab.h5 100 vocab=none
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=novocab.h5)
      expect=("token dataset 'novocab.h5': 'tokens' has no attribute 'vocab_size' (expected an integer)") ;;
    vocab_float)
      make_tokens floatvocab.h5 100 vocab=float
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=floatvocab.h5)
      expect=("token dataset 'floatvocab.h5': attribute 'vocab_size' of 'tokens' is not an integer") ;;
    vocab_zero)
      make_tokens zerovocab.h5 100 vocab=0
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=zerovocab.h5)
      expect=("token dataset 'zerovocab.h5': attribute 'vocab_size' is 0; expected 1 to 65536 for uint16 tokens") ;;
    vocab_type_limit)
      make_tokens widevocab.h5 100 vocab=70000
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=widevocab.h5)
      expect=("attribute 'vocab_size' is 70000; expected 1 to 65536 for uint16 tokens") ;;
    vocab_over_model)  # ringattn-data's byte vocabulary (256) for a model of 128
      text_dataset text 4000
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=text.train.h5
               --set model.vocab_size=128)
      expect=("token dataset 'text.train.h5' has vocab_size 256 (tokenizer 'byte'), more than model.vocab_size 128") ;;
    no_tokenizer)
      make_tokens notok.h5 100 tokenizer=none
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=notok.h5)
      expect=("token dataset 'notok.h5': 'tokens' has no attribute 'tokenizer'") ;;
    tokenizer_number)
      make_tokens numtok.h5 100 tokenizer=int
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=numtok.h5)
      expect=("token dataset 'numtok.h5': attribute 'tokenizer' of 'tokens' is not a string") ;;
    empty)
      make_tokens empty.h5 0
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=empty.h5)
      expect=("token dataset 'empty.h5' holds 0 tokens; one sequence of train.seq_len = 16 needs 17") ;;
    too_short)  # ringattn-data's 16 tokens for sequences of 16 (+1 target)
      text_dataset text 16
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=text.train.h5)
      expect=("token dataset 'text.train.h5' holds 16 tokens; one sequence of train.seq_len = 16 needs 17") ;;
    val_missing)  # a good training set, a validation set that is not there
      text_dataset text 4000
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=text.train.h5
               --set data.val_path=text.val.h5 --set train.eval_every=1)
      expect=("TokenDataset: token dataset 'text.val.h5' does not exist") ;;
    val_too_short)
      text_dataset text 4000
      text_dataset short 10
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=text.train.h5
               --set data.val_path=short.train.h5 --set train.eval_every=1)
      expect=("token dataset 'short.train.h5' holds 10 tokens; one sequence of train.seq_len = 16 needs 17") ;;
    token_over_vocab)  # found by the datasets' identity check before step 1
      make_tokens bad.h5 100 bad=5:300
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=bad.h5)
      expect=("token dataset 'bad.h5': token 300 at position 5 is outside the vocabulary [0, 256)") ;;

    # ---- two ranks ----
    dtype_np2)
      make_tokens float.h5 1000 type=float32
      command=("${np2[@]}" "$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=float.h5
               --set train.seq_len=16)
      expect=("'tokens' has type float32; expected uint16 or uint32 (on every rank)") ;;
    token_rank1_np2)  # rank 1's copy alone has a token outside the vocabulary: rank 1 is named
      mkdir rank0 rank1
      make_tokens rank0/long.h5 8193
      make_tokens rank1/long.h5 8193 bad=4096:300
      local args=("$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=long.h5
                  --set train.seq_len=8192 --set train.batch_size=1)
      command=("$mpiexec" -n 1 -wdir rank0 "${args[@]}" : -n 1 -wdir rank1 "${args[@]}")
      expect=("Trainer: rank 1: TokenDataset: token dataset 'long.h5': token 300 at position 4096 is outside the vocabulary [0, 256)")
      absent=("rank 0:" "(on every rank)") ;;
    copy_rank1_np2)  # rank 1's copy of the dataset has the wrong type
      mkdir rank0 rank1
      make_tokens rank0/tokens.h5 1000
      make_tokens rank1/tokens.h5 1000 type=float32
      local args=("$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=tokens.h5 --set train.seq_len=16)
      command=("$mpiexec" -n 1 -wdir rank0 "${args[@]}" : -n 1 -wdir rank1 "${args[@]}")
      expect=("Trainer: rank 1: TokenDataset: token dataset 'tokens.h5': 'tokens' has type float32; expected uint16 or uint32") ;;
    token_both_np2)  # a bad token every rank finds: said once, (on every rank)
      make_tokens bad.h5 1000 bad=6:300
      command=("${np2[@]}" "$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=bad.h5
               --set train.seq_len=16)
      expect=("token 300 at position 6 is outside the vocabulary [0, 256) (on every rank)") ;;
    copy_differs_middle_np2)  # copies that differ only in the middle: the identity digest tells
      mkdir rank0 rank1
      make_tokens rank0/tokens.h5 10000
      make_tokens rank1/tokens.h5 10000 bad=5000:3
      local args=("$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=tokens.h5 --set train.seq_len=16)
      command=("$mpiexec" -n 1 -wdir rank0 "${args[@]}" : -n 1 -wdir rank1 "${args[@]}")
      expect=("the ranks disagree: rank 0 has data.train_path") ;;
    documents_missing)  # data.documents asked of a dataset without document_starts
      make_tokens plain.h5 100
      command=("$train" "${quick[@]}" "${hdf5[@]}" --set data.train_path=plain.h5
               --set data.documents=true)
      expect=("data.documents is true but token dataset 'plain.h5' has no document_starts") ;;
    documents_differ_np2)  # the same tokens, other documents on rank 1: the identity digest tells
      mkdir rank0 rank1
      head -c 4000 "$source/README.md" >text.txt
      "$build/ringattn-data" --val-fraction 0 --out rank0/text text.txt >/dev/null ||
        setup_failed "ringattn-data --out rank0/text"
      "$build/ringattn-data" --val-fraction 0 --eod-token 10 --out rank1/text text.txt >/dev/null ||
        setup_failed "ringattn-data --out rank1/text"
      local args=("$train" "${tiny[@]}" "${hdf5[@]}" --set data.train_path=text.train.h5 --set train.seq_len=16)
      command=("$mpiexec" -n 1 -wdir rank0 "${args[@]}" : -n 1 -wdir rank1 "${args[@]}")
      expect=("the ranks disagree: rank 0 has data.train_path" "document starts") ;;
    *) return 1 ;;
  esac
}
