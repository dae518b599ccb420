# shellcheck shell=bash disable=SC2034,SC2154  # the variables are run_case.sh's
# Fault cases of category `config` (sourced by tests/faults/run_case.sh): ringattn-train refusing a
# config before any work, on one rank (a singleton, no mpiexec) or, for the cases named *_np2, on two
# ranks under mpiexec, where every rank meets the fault alike and rank 0 says it once, with
# "(on every rank)". Each case names the key or file, its value and what was expected:
#   set_*    --set overrides: wrong type, out of the type's range, malformed, unknown keys
#   range_*  values validate() refuses (train/config.cpp), one key at a time
#   yaml_*   config files derived from configs/tiny-cpu.yaml: wrong types, unknown keys, duplicate
#            keys, misspelled sections, YAML syntax errors
#   file_*   the config file itself: missing, a directory, unreadable, not a file to read
# The real rules and messages are those of train/config.cpp (validate, load_config_*).

define_case() {
  case $1 in
    # ---- --set: the value's type ----
    set_int_text)  # text where an integer goes
      command=("$train" "${tiny1[@]}" --set model.d_model=abc)
      expect=("--set model.d_model=abc: model.d_model is 'abc'; expected an integer") ;;
    set_int_overflow)  # one past INT_MAX
      command=("$train" "${tiny1[@]}" --set train.steps=2147483648)
      expect=("train.steps is '2147483648'; expected an integer") ;;
    set_int_plus_sign)
      command=("$train" "${tiny1[@]}" --set train.batch_size=+8)
      expect=("train.batch_size is '+8'; expected an integer") ;;
    set_uint_negative)  # the seed is unsigned
      command=("$train" "${tiny1[@]}" --set train.seed=-1)
      expect=("train.seed is '-1'; expected a non-negative integer") ;;
    set_float_nan)
      command=("$train" "${tiny1[@]}" --set train.lr=nan)
      expect=("--set train.lr=nan: train.lr is 'nan'; expected a number") ;;
    set_float_inf)
      command=("$train" "${tiny1[@]}" --set train.weight_decay=inf)
      expect=("train.weight_decay is 'inf'; expected a number") ;;
    set_float_overflow)  # beyond double
      command=("$train" "${tiny1[@]}" --set train.lr=1e400)
      expect=("train.lr is '1e400'; expected a number") ;;
    set_bool_yes)  # YAML 1.1's yes is not a YAML 1.2 bool
      command=("$train" "${tiny1[@]}" --set model.tied_embeddings=yes)
      expect=("model.tied_embeddings is 'yes'; expected true or false") ;;
    set_enum_layout)
      command=("$train" "${tiny1[@]}" --set parallel.layout=diagonal)
      expect=("parallel.layout is 'diagonal'; expected one of zigzag, contiguous") ;;
    set_enum_backend)
      command=("$train" "${tiny1[@]}" --set run.backend=tpu)
      expect=("run.backend is 'tpu'; expected one of auto, cuda, cpu") ;;
    set_stages_shape)  # a stage without its seq_len
      command=("$train" "${tiny1[@]}" --set "train.stages=[{steps: 5}]")
      expect=("train.stages is '[{steps: 5}]'; expected a list of stages, each {steps: N, seq_len: N}") ;;
    # ---- --set: the form and the key ----
    set_no_equals)
      command=("$train" "${tiny1[@]}" --set train.steps)
      expect=("--set 'train.steps' is not of the form key=value (e.g. train.lr=3e-4)") ;;
    set_empty_key)
      command=("$train" "${tiny1[@]}" --set "=5")
      expect=("--set '=5' is not of the form key=value") ;;
    set_unknown_section)
      command=("$train" "${tiny1[@]}" --set bogus.key=1)
      expect=("unknown key 'bogus.key'; the sections are model, train, parallel, data, run") ;;
    set_unknown_in_section)  # far from every key: the section's keys are listed
      command=("$train" "${tiny1[@]}" --set model.expert_count=5)
      expect=("unknown key 'model.expert_count'; section 'model' has vocab_size, d_model") ;;
    set_suggestion_initials)  # initials suggest only keys of the named section, not parallel.dp
      command=("$train" "${tiny1[@]}" --set model.dropout_probability=0.1)
      expect=("unknown key 'model.dropout_probability'; section 'model' has vocab_size, d_model")
      absent=("did you mean 'parallel.dp'") ;;
    set_misspelled_key)
      command=("$train" "${tiny1[@]}" --set train.warmup_step=2)
      expect=("unknown key 'train.warmup_step'; did you mean 'train.warmup_steps'?") ;;
    set_long_name)  # initials: learning_rate -> lr
      command=("$train" "${tiny1[@]}" --set train.learning_rate=1e-3)
      expect=("unknown key 'train.learning_rate'; did you mean 'train.lr'?") ;;
    set_wrong_section)  # seq_len lives in train
      command=("$train" "${tiny1[@]}" --set model.seq_len=128)
      expect=("unknown key 'model.seq_len'; did you mean 'train.seq_len'?") ;;
    set_section_only)
      command=("$train" "${tiny1[@]}" --set train=1)
      expect=("'train' is a section; --set takes a whole key such as 'train.seq_len'") ;;
    # ---- validate(): one key out of range ----
    range_vocab_size)
      command=("$train" "${tiny1[@]}" --set model.vocab_size=1)
      expect=("model.vocab_size is 1; expected at least 2") ;;
    range_n_layers)
      command=("$train" "${tiny1[@]}" --set model.n_layers=0)
      expect=("model.n_layers is 0; expected at least 1") ;;
    range_n_heads)
      command=("$train" "${tiny1[@]}" --set model.n_heads=-4)
      expect=("model.n_heads is -4; expected at least 1") ;;
    range_kv_heads_ratio)
      command=("$train" "${tiny1[@]}" --set model.n_kv_heads=3)
      expect=("model.n_heads (4) is not a multiple of model.n_kv_heads (3)") ;;
    range_d_model_heads)
      command=("$train" "${tiny1[@]}" --set model.d_model=66)
      expect=("model.d_model (66) is not a multiple of model.n_heads (4)") ;;
    range_odd_head_dim)
      command=("$train" "${tiny1[@]}" --set model.head_dim=7)
      expect=("the head dimension 7 (model.head_dim) is odd; RoPE rotates pairs of dimensions") ;;
    range_ffn_hidden)
      command=("$train" "${tiny1[@]}" --set model.ffn_hidden=0)
      expect=("model.ffn_hidden is 0; expected at least 1") ;;
    range_rope_theta)
      command=("$train" "${tiny1[@]}" --set model.rope_theta=0)
      expect=("model.rope_theta is 0; expected a number > 0") ;;
    range_norm_eps)
      command=("$train" "${tiny1[@]}" --set model.norm_eps=-1e-5)
      expect=("model.norm_eps is -1.0e-05; expected a number > 0") ;;
    range_init_std)
      command=("$train" "${tiny1[@]}" --set model.init_std=0)
      expect=("model.init_std is 0; expected a number > 0") ;;
    range_attention_window)
      command=("$train" "${tiny1[@]}" --set model.attention_window=-1)
      expect=("model.attention_window is -1; expected 0 (no window) or the number of tokens a query sees") ;;
    range_documents_retrieval)
      command=("$train" "${tiny1[@]}" --set data.documents=true)
      expect=("data.documents is true but data.source is retrieval") ;;
    range_rope_documents_off)
      command=("$train" "${tiny1[@]}" --set data.source=hdf5 --set data.train_path=t.h5
               --set data.documents=false --set model.rope_document_positions=true)
      expect=("model.rope_document_positions is true but data.documents is false") ;;
    range_seq_len_layout)  # zigzag on one rank needs an even length
      command=("$train" "${tiny1[@]}" --set train.seq_len=255)
      expect=("train.seq_len (255) is not a multiple of 2 * parallel.cp = 2, which the zigzag layout needs") ;;
    range_batch_size)
      command=("$train" "${tiny1[@]}" --set train.batch_size=0)
      expect=("train.batch_size is 0; expected at least 1") ;;
    range_grad_accum)
      command=("$train" "${tiny1[@]}" --set train.grad_accum=-1)
      expect=("train.grad_accum is -1; expected at least 1") ;;
    range_steps)
      command=("$train" "${tiny1[@]}" --set train.steps=0 --set train.warmup_steps=0)
      expect=("train.steps is 0; expected at least 1") ;;
    range_lr)
      command=("$train" "${tiny1[@]}" --set train.lr=-0.001 --set train.min_lr=0)
      expect=("train.lr is -0.001; expected a number > 0") ;;
    range_min_lr)
      command=("$train" "${tiny1[@]}" --set train.min_lr=1)
      expect=("train.min_lr is 1; expected 0 <= min_lr <= train.lr (0.003)") ;;
    range_weight_decay)
      command=("$train" "${tiny1[@]}" --set train.weight_decay=-0.1)
      expect=("train.weight_decay is -0.1; expected at least 0") ;;
    range_beta1)
      command=("$train" "${tiny1[@]}" --set train.beta1=1)
      expect=("train.beta1 is 1; expected 0 <= beta1 < 1") ;;
    range_adam_eps)
      command=("$train" "${tiny1[@]}" --set train.adam_eps=0)
      expect=("train.adam_eps is 0; expected a number > 0") ;;
    range_grad_clip)
      command=("$train" "${tiny1[@]}" --set train.grad_clip=-1)
      expect=("train.grad_clip is -1; expected at least 0") ;;
    range_recompute_attention)
      command=("$train" "${tiny1[@]}" --set train.recompute_attention=true)
      expect=("train.recompute_attention is true but train.recompute is false") ;;
    range_loss_chunk_tokens)
      command=("$train" "${tiny1[@]}" --set train.loss_chunk_tokens=0)
      expect=("train.loss_chunk_tokens is 0; expected at least 1") ;;
    range_log_every)
      command=("$train" "${tiny1[@]}" --set train.log_every=0)
      expect=("train.log_every is 0; expected at least 1") ;;
    range_eval_every)
      command=("$train" "${tiny1[@]}" --set train.eval_every=-1)
      expect=("train.eval_every is -1; expected at least 0") ;;
    range_eval_batches)
      command=("$train" "${tiny1[@]}" --set train.eval_batches=0)
      expect=("train.eval_batches is 0; expected at least 1") ;;
    range_checkpoint_every)
      command=("$train" "${tiny1[@]}" --set train.checkpoint_every=-5)
      expect=("train.checkpoint_every is -5; expected at least 0") ;;
    range_keep_checkpoints)
      command=("$train" "${tiny1[@]}" --set train.keep_checkpoints=0)
      expect=("train.keep_checkpoints is 0; expected at least 1") ;;
    range_dp)
      command=("$train" "${tiny1[@]}" --set parallel.dp=0)
      expect=("parallel.dp is 0; expected at least 1") ;;
    range_cp_world)  # 3 ranks asked of a job of 1
      command=("$train" "${tiny1[@]}" --set parallel.cp=3 --set train.seq_len=258)
      expect=("parallel.dp x parallel.cp = 1 x 3 = 3 ranks, but the job has 1; choose dp and cp with dp * cp = 1") ;;
    range_hdf5_paths)  # data.source hdf5 without its datasets: two problems, both named
      command=("$train" "${tiny1[@]}" --set data.source=hdf5 --set train.eval_every=5)
      expect=("2 problems in the config:" "data.train_path is empty; data.source hdf5 needs a dataset"
              "data.val_path is empty; evaluation (train.eval_every = 5) needs a validation dataset") ;;
    range_run_dir_empty)
      command=("$train" "${tiny1[@]}" --set run.dir=)
      expect=("run.dir is empty; expected the run's directory") ;;
    range_stages_sum)
      command=("$train" "${tiny1[@]}" --set "train.stages=[{steps: 20, seq_len: 256}, {steps: 20, seq_len: 512}]")
      expect=("train.stages add up to 40 steps but train.steps is 12; set train.steps to 40") ;;
    range_retrieval_pairs)
      command=("$train" "${tiny1[@]}" --set data.retrieval.pairs=0)
      expect=("data.retrieval.pairs is 0; expected at least 1") ;;
    range_retrieval_fit)  # more pairs than the sequence holds
      command=("$train" "${tiny1[@]}" --set data.retrieval.pairs=100 --set data.retrieval.key_tokens=2)
      expect=("the retrieval task's 100 pairs of 3 tokens and 1 queries of 4 tokens need 304 tokens"
              "fewer (lower data.retrieval.pairs or queries)") ;;
    range_cuda_head_dim)  # the CUDA block's head dims, checked whether or not a GPU is here
      command=("$train" "${tiny1[@]}" --set run.backend=cuda)
      expect=("model.d_model 64 / model.n_heads 4 gives head_dim 16; the CUDA block takes 32, 64, 96, 128, 192 or 256") ;;
    range_several)  # every problem is listed, under one count
      command=("$train" "${tiny1[@]}" --set model.n_layers=0 --set train.beta1=2 --set train.log_every=0)
      expect=("3 problems in the config:" "model.n_layers is 0; expected at least 1"
              "train.beta1 is 2; expected 0 <= beta1 < 1" "train.log_every is 0; expected at least 1") ;;

    # ---- YAML files ----
    yaml_wrong_type)
      derive_config bad.yaml 's/^  d_model: 64$/  d_model: sixty-four/'
      command=("$train" bad.yaml)
      expect=("load_config: bad.yaml:15: model.d_model is 'sixty-four'; expected an integer") ;;
    yaml_bool_number)
      derive_config bad.yaml 's/^  recompute: false$/  recompute: 1/'
      command=("$train" bad.yaml)
      expect=("train.recompute is '1'; expected true or false") ;;
    yaml_negative_seed)
      derive_config bad.yaml 's/^  seed: 1234$/  seed: -1/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:37: train.seed is '-1'; expected a non-negative integer") ;;
    yaml_map_for_scalar)
      derive_config bad.yaml 's/^  batch_size: 8$/  batch_size:\n    value: 8/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:27: train.batch_size is a map; expected an integer") ;;
    yaml_misspelled_section)
      derive_config bad.yaml 's/^model:$/modle:/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:13: unknown key 'modle'; did you mean 'model'?") ;;
    yaml_unknown_key)
      derive_config bad.yaml 's/^  n_layers: 2$/  n_layers: 2\n  dropout: 0.1/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:17: unknown key 'model.dropout'; section 'model' has vocab_size, d_model") ;;
    yaml_unknown_nested_key)
      derive_config bad.yaml 's/^    pairs: 1$/    pairz: 1/'
      command=("$train" bad.yaml)
      expect=("unknown key 'data.retrieval.pairz'; did you mean 'data.retrieval.pairs'?") ;;
    yaml_section_scalar)
      printf 'run: cpu\n' >bad.yaml
      command=("$train" bad.yaml)
      expect=("bad.yaml:1: run is 'cpu'; expected a map of keys such as 'run.dir'") ;;
    yaml_duplicate_key)
      derive_config bad.yaml 's/^  lr: 3.0e-3$/  lr: 3.0e-3\n  lr: 1.0e-3/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:30: key 'train.lr' is given twice (first on line 29)") ;;
    yaml_unclosed_list)
      derive_config bad.yaml 's/^  seq_len: 256$/  seq_len: [256/'
      command=("$train" bad.yaml)
      expect=("load_config: bad.yaml:26:13: YAML syntax error: end of sequence flow not found") ;;
    yaml_tab_indent)
      derive_config bad.yaml 's/^  steps: 400$/\tsteps: 400/'
      command=("$train" bad.yaml)
      expect=("bad.yaml:28:1: YAML syntax error: illegal tab when looking for indentation") ;;
    yaml_list_document)
      printf -- '- model\n- train\n' >bad.yaml
      command=("$train" bad.yaml)
      expect=("bad.yaml:1: the document is a list; expected a map of sections (model, train, parallel, data, run)") ;;
    yaml_comments_only)
      printf '# nothing but a comment\n' >bad.yaml
      command=("$train" bad.yaml)
      expect=("load_config: bad.yaml: the config sets no key") ;;
    yaml_second_document)  # a second YAML document: refused, naming its line
      printf 'model:\n  vocab_size: 256\n---\ntrain:\n  steps: 3\n' >bad.yaml
      command=("$train" bad.yaml --print-config)
      expect=("bad.yaml" "document") ;;

    # ---- the config file itself ----
    file_missing)
      command=("$train" missing.yaml)
      expect=("load_config: config file 'missing.yaml' does not exist") ;;
    file_directory)
      mkdir conf.yaml
      command=("$train" conf.yaml)
      expect=("load_config: config file 'conf.yaml' is a directory; expected a YAML file") ;;
    file_unreadable)  # mode 000; root reads anything, so the program then runs as nobody
      cp "$tiny_yaml" locked.yaml
      chmod 000 locked.yaml
      chmod 755 "$work"
      command=("$train" locked.yaml)
      if [[ $(id -u) -eq 0 ]]; then
        command=(setpriv --reuid=65534 --regid=65534 --clear-groups "${command[@]}")
      fi
      expect=("load_config: config file 'locked.yaml' could not be read") ;;
    file_not_yaml)  # a binary file
      head -c 64 "$train" >binary.yaml
      command=("$train" binary.yaml)
      expect=("load_config: binary.yaml:1" "YAML syntax error") ;;
    file_fifo)  # a FIFO without a writer: refused before any read, never a hang
      mkfifo pipe.yaml
      command=("$train" pipe.yaml)
      hang_s=15
      expect=("config file 'pipe.yaml'") ;;
    file_read_error)  # a read error (EIO): said as one, not as an empty file
      command=("$train" /proc/self/mem)
      expect=("config file '/proc/self/mem' could not be read") ;;

    # ---- validation and memory ----
    range_seq_len_zero)  # one problem, said once
      command=("$train" "${tiny1[@]}" --set train.seq_len=0)
      expect=("train.seq_len is 0; expected at least 1") ;;
    huge_d_model)  # refused before step 1, naming the parts, sizes and keys
      command=("$train" "${tiny1[@]}" --set model.d_model=1073741824)
      vm_limit_kb=4000000
      expect=("model.d_model") ;;
    huge_vocab)  # the same for the embedding's vocabulary
      command=("$train" "${tiny1[@]}" --set model.vocab_size=2147483647)
      vm_limit_kb=4000000
      expect=("model.vocab_size") ;;
    huge_n_layers)  # the same for the layers, before any is allocated
      command=("$train" "${tiny1[@]}" --set model.n_layers=2147483647)
      vm_limit_kb=4000000
      expect=("model.n_layers") ;;
    huge_grad_accum)  # the same for the micro-batches of a step
      command=("$train" "${tiny1[@]}" --set train.grad_accum=2147483647)
      vm_limit_kb=4000000
      expect=("train.grad_accum") ;;

    # ---- two ranks: one message, "(on every rank)" ----
    yaml_syntax_np2)
      derive_config bad.yaml 's/^  seq_len: 256$/  seq_len: [256/'
      command=("${np2[@]}" "$train" bad.yaml)
      expect=("bad.yaml:26:13: YAML syntax error: end of sequence flow not found (on every rank)") ;;
    set_unknown_key_np2)
      command=("${np2[@]}" "$train" "${tiny[@]}" --set train.learning_rate=1e-3)
      expect=("unknown key 'train.learning_rate'; did you mean 'train.lr'? (on every rank)") ;;
    range_cp_world_np2)  # a job of 2 ranks asked for 1
      command=("${np2[@]}" "$train" "${tiny[@]}" --set parallel.cp=1)
      expect=("parallel.dp x parallel.cp = 1 x 1 = 1 ranks, but the job has 2; choose dp and cp with dp * cp = 2 (on every rank)") ;;
    print_config_np2)  # --print-config prints nothing of a config it cannot read
      command=("${np2[@]}" "$train" "${tiny[@]}" --set model.n_heads=four --print-config)
      expect=("model.n_heads is 'four'; expected an integer (on every rank)")
      absent=("vocab_size:") ;;
    *) return 1 ;;
  esac
}
