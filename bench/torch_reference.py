"""ringattn-train's transformer in plain PyTorch, timed on one GPU: tokens/s, MFU and peak memory.

The model is the trainer's (train/model_shapes.hpp, train/model_cpu.cpp), parameter for parameter:

    tok_embedding -> L x [RMSNorm -> wqkv (no bias; rows q heads | k heads | v heads) -> RoPE on
    q, k (half-split, angle = pos * theta^(-2i/head_dim)) -> causal SDPA (GQA through enable_gqa)
    -> wo -> residual -> RMSNorm -> w_gate_up -> silu(gate) * up -> w_down -> residual]
    -> final RMSNorm -> lm_head (or the tied embedding) -> cross-entropy in fp32

trained on random tokens with bf16 autocast (fp32 weights), gradient clipping at 1.0 and fused
AdamW (lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on the matrices other than the embedding, as
the trainer). --recompute checkpoints each block (torch.utils.checkpoint, use_reentrant=False).
--profile PREFIX runs two more steps per shape under torch.profiler and writes each kernel's device
time over them to PREFIX-SEQxBATCH.txt (the timed steps are not profiled).
--documents MU,SIGMA packs each row with documents of log-normal lengths (as the text files of
bench/trainer_documents.sh; drawn here with a seed of their own, so the lengths follow the same law
but not the same draw): attention causal within each document through FlexAttention (its block
mask made once per shape, before the steps; compiled with the model), RoPE positions restarting at
each document, and no loss where a document's last token would predict the next one's first.

Model FLOPs per token (recomputation not counted, so MFU means the same with and without it):

    6 * N_matmul + 6 * L * n_heads * head_dim * seq

    N_matmul = L * (wqkv + wo + w_gate_up + w_down) + vocab * d_model: the weights of every matrix
      product, the output head counted once whether tied or not (the embedding lookup and the norm
      gains are no matrix products); 6 = 2 (multiply-add) x 3 (forward, grad input, grad weight).
    attention: QK^T and PV are 4 * head_dim FLOPs per (query, key) pair and head in the forward,
      12 with the backward, over seq keys: 12 * L * n_heads * head_dim * seq, halved for causal;
      with --documents, over the mean count of keys a query sees instead.

MFU = FLOPs per token * tokens/s / --peak-tflops (989: H200 dense bf16). Step time is the median
of the timed steps (torch.cuda.synchronize + time.perf_counter); peak memory is
torch.cuda.max_memory_allocated, reset for each shape. An out-of-memory shape is reported as "oom".
Each row also has its timed steps' span on the wall clock (timed_window_unix: Unix seconds) and
their tokens (timed_tokens), which bench/trainer.sh matches against its power samples.
Several shapes in one process can run slower than each in a process of its own (32k x 1 after
8k x 4: 2.5% on an H200), so bench/trainer.sh gives each shape its own process.

    python3 bench/torch_reference.py --shapes 8192x4,32768x1,131072x1 --json out.json
    python3 bench/torch_reference.py --fit          # the longest seq that trains at batch 1
    python3 bench/torch_reference.py --config configs/tiny-cpu.yaml --device cpu --no-compile \\
        --shapes 256x2 --steps 3 --warmup 1
"""
import argparse
import datetime
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

# The trainer's defaults for keys a config file leaves out (TrainConfig{} = configs/tiny-cpu.yaml).
TRAINER_DEFAULTS = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=None, ffn_hidden=176, tied_embeddings=True, rope_theta=10000.0,
                        norm_eps=1e-5, init_std=0.02)
# Without --config: the small-32k shape (configs/small-32k.yaml), 188M parameters.
SMALL_32K = dict(TRAINER_DEFAULTS, vocab_size=32768, d_model=1024, n_layers=12, n_heads=8,
                 n_kv_heads=8, ffn_hidden=2816)
INT_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden")


def load_model_config(path):
    """The model: section of a trainer config, over the trainer's defaults."""
    try:
        import yaml
        with open(path) as f:
            section = (yaml.safe_load(f) or {}).get("model") or {}
    except ImportError:  # a tiny parser for the flat `model:` section
        section, inside = {}, False
        with open(path) as f:
            for line in f:
                body = line.split("#")[0].rstrip()
                if not body.strip():
                    continue
                if not body[0].isspace():
                    inside = body.strip() == "model:"
                elif inside and ":" in body:
                    key, value = body.split(":", 1)
                    section[key.strip()] = value.strip().strip("\"'")
    unknown = sorted(set(section) - set(TRAINER_DEFAULTS))
    if unknown:
        sys.exit(f"{path}: unknown model keys {unknown}")
    cfg = dict(TRAINER_DEFAULTS, **section)
    for key in INT_KEYS:
        cfg[key] = None if cfg[key] in (None, "null", "~", "") else int(cfg[key])
    for key in ("rope_theta", "norm_eps", "init_std"):
        cfg[key] = float(cfg[key])
    if isinstance(cfg["tied_embeddings"], str):
        cfg["tied_embeddings"] = cfg["tied_embeddings"].lower() in ("true", "yes", "on")
    return cfg


def rope(x, cos, sin):
    """Half-split RoPE on [B, S, H, D]: dimension i is rotated with i + D/2 (fp32 math)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd, f = c["d_model"], c["head_dim"], c["ffn_hidden"]
        self.hq, self.hkv, self.hd = c["n_heads"], c["n_kv_heads"], hd
        self.attn_norm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.wqkv = nn.Linear(d, (self.hq + 2 * self.hkv) * hd, bias=False)
        self.wo = nn.Linear(self.hq * hd, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.w_gate_up = nn.Linear(d, 2 * f, bias=False)  # rows: gate, then up
        self.w_down = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin, block_mask=None):
        b, s, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).view(b, s, self.hq + 2 * self.hkv, self.hd)
        q, k, v = qkv.split([self.hq, self.hkv, self.hkv], dim=2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if block_mask is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=self.hq != self.hkv)
        else:  # packed documents: causal within each
            o = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               block_mask=block_mask, enable_gqa=self.hq != self.hkv)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, self.hq * self.hd))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, c, seq, recompute):
        super().__init__()
        self.recompute = recompute
        self.tok_embedding = nn.Embedding(c["vocab_size"], c["d_model"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.final_norm = nn.RMSNorm(c["d_model"], eps=c["norm_eps"])
        self.lm_head = None if c["tied_embeddings"] else nn.Linear(c["d_model"], c["vocab_size"],
                                                                   bias=False)
        # RoPE tables [seq, 1, head_dim / 2], angles in fp64 as the trainer forms them.
        hd = c["head_dim"]
        inv_freq = c["rope_theta"] ** (-2.0 * torch.arange(hd // 2, dtype=torch.float64) / hd)
        angle = torch.arange(seq, dtype=torch.float64)[:, None, None] * inv_freq
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)
        for p in self.parameters():  # N(0, init_std) matrices, unit norm gains
            if p.dim() == 2:
                nn.init.normal_(p, std=c["init_std"])
            else:
                nn.init.ones_(p)

    def forward(self, tokens, targets, positions=None, block_mask=None):
        """positions [B, S]: each token's RoPE position (None: its place in the row)."""
        h = self.tok_embedding(tokens)
        cos, sin = self.cos, self.sin
        if positions is not None:  # [B, S, 1, head_dim / 2]
            cos, sin = cos[positions], sin[positions]
        for block in self.layers:
            if self.recompute:
                h = checkpoint(block, h, cos, sin, block_mask, use_reentrant=False)
            else:
                h = block(h, cos, sin, block_mask)
        head = self.tok_embedding.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.final_norm(h), head)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def counts(c):
    """(trainer parameter_list count, N_matmul), from train/model_shapes.cpp's shapes."""
    d, hd, f, v, L = c["d_model"], c["head_dim"], c["ffn_hidden"], c["vocab_size"], c["n_layers"]
    per_layer = (c["n_heads"] + 2 * c["n_kv_heads"]) * hd * d + d * c["n_heads"] * hd + 3 * f * d
    params = v * d + L * (per_layer + 2 * d) + d + (0 if c["tied_embeddings"] else v * d)
    return params, L * per_layer + v * d


def flops_per_token(c, seq, keys_per_query=None):
    """keys_per_query: the mean count of keys a query sees, (seq + 1) / 2 causal (the default
    counts seq / 2)."""
    keys = seq / 2 if keys_per_query is None else keys_per_query
    return 6 * counts(c)[1] + 12 * c["n_layers"] * c["n_heads"] * c["head_dim"] * keys


def packed_documents(batch, seq, mu, sigma, generator):
    """Document ids [batch, seq + 1] of rows packed with documents of log-normal lengths (natural
    log mean mu, sigma; at least 16 tokens; the last one cut at the row's end), each token's
    position in its document, and the mean count of keys a query sees (causal within its
    document) over the first seq tokens."""
    ids = torch.empty(batch, seq + 1, dtype=torch.int64)
    positions = torch.empty(batch, seq + 1, dtype=torch.int64)
    pairs = 0
    for b in range(batch):
        start, doc = 0, 0
        while start < seq + 1:
            length = max(16, int(torch.empty(1).log_normal_(mu, sigma, generator=generator)))
            end = min(start + length, seq + 1)
            ids[b, start:end] = doc
            positions[b, start:end] = torch.arange(end - start)
            visible = min(end, seq) - start
            pairs += visible * (visible + 1) // 2 if visible > 0 else 0
            start, doc = end, doc + 1
    return ids, positions, pairs / (batch * seq)


def train_steps(args, c, device, seq, batch, recompute, steps):
    """Builds the model for one shape and runs `steps` optimizer steps; returns each step's ms and
    the Unix times (wall clock) at which each started and ended."""
    torch.manual_seed(1234)
    with device:  # built (and initialised) where it runs
        model = Model(c, seq, recompute)
    # Weight decay on the matrices other than the embedding (ParameterInfo::weight_decay).
    groups = ([], [])
    for name, p in model.named_parameters():
        groups[p.dim() == 2 and name != "tok_embedding.weight"].append(p)
    opt = torch.optim.AdamW([{"params": groups[1], "weight_decay": 0.1},
                             {"params": groups[0], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    run = torch.compile(model) if args.compile else model
    data = torch.randint(0, c["vocab_size"], (batch, seq + 1), device=device)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    positions = block_mask = None
    if args.documents:
        # No loss across a boundary: a document's last token predicts nothing (-100: ignored).
        ids, positions, _ = packed_documents(batch, seq, *args.documents,
                                             torch.Generator().manual_seed(99))
        ids, positions = ids.to(device), positions[:, :-1].contiguous().to(device)
        targets = targets.masked_fill(ids[:, 1:] != ids[:, :-1], -100)
        doc = ids[:, :-1].contiguous()

        def same_document_causal(b, h, q, kv):
            return (doc[b, q] == doc[b, kv]) & (kv <= q)
        block_mask = create_block_mask(same_document_causal, batch, None, seq, seq,
                                       device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run(tokens, targets, positions, block_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, starts, ends = [], [], []
    for _ in range(steps):
        sync(device)
        starts.append(time.time())
        start = time.perf_counter()
        loss = step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        ends.append(time.time())
    if args.profile and device.type == "cuda" and steps > 0:
        # Two more steps, untimed, under the profiler: the device time of each kernel.
        activity = torch.profiler.ProfilerActivity.CUDA
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(2):
                step()
            sync(device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                          max_name_column_width=90)
        with open(f"{args.profile}-{seq}x{batch}.txt", "w") as f:
            f.write(f"PyTorch kernels over 2 steps of seq {seq} x batch {batch}\n{table}\n")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss {loss.item()} at seq {seq}")
    return times, starts, ends


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, c, device, seq, batch, recompute, steps, warmup):
    """One shape: a result row; out-of-memory is caught, reported and its memory freed."""
    torch._dynamo.reset()  # a fresh compile per shape (no dynamic-shape graphs, no stale modules)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    row = dict(seq=seq, batch=batch, recompute=recompute, step_ms=None, tokens_per_s=None,
               mfu=None, peak_mib=None, status="ok")
    try:
        times, starts, ends = train_steps(args, c, device, seq, batch, recompute, warmup + steps)
        times = times[warmup:]
    except RuntimeError as error:  # torch.OutOfMemoryError, or OOM wrapped by the compiler
        if not (isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)):
            raise
        row["status"] = "oom"
    if row["status"] == "ok":
        ms = statistics.median(times)
        tps = batch * seq / (ms / 1e3)
        keys = None
        if args.documents:
            keys = packed_documents(batch, seq, *args.documents,
                                    torch.Generator().manual_seed(99))[2]
            row["keys_per_query"] = round(keys, 1)
        row.update(step_ms=round(ms, 3), tokens_per_s=round(tps, 1),
                   mfu=round(flops_per_token(c, seq, keys) * tps / (args.peak_tflops * 1e12), 4))
        if times:
            # The timed steps on the wall clock, for power samples (bench/power.py).
            row["timed_window_unix"] = [round(starts[warmup], 3), round(ends[-1], 3)]
            row["timed_tokens"] = batch * seq * len(times)
        if device.type == "cuda":
            row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    torch._dynamo.reset()  # drop the compiled graphs' references before freeing memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def show(row):
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"seq {row['seq']:>8} x {row['batch']:<3} recompute {str(row['recompute']):5} "
          f"step {fmt(row['step_ms'], '10.1f')} ms  {fmt(row['tokens_per_s'], '10.0f')} tok/s  "
          f"MFU {fmt(row['mfu'] and 100 * row['mfu'], '5.1f')}%  "
          f"peak {fmt(row['peak_mib'], '8.0f')} MiB  {row['status']}", flush=True)


def fit(args, c, device, over_budget):
    """The longest seq (batch 1, recompute on) that trains one step: doubling from --fit-start,
    then bisection between the last success and the first failure at --fit-granularity.
    Returns (longest seq or 0, the trials, why the search ended early or None)."""
    trials, lo, hi, seq, g = [], 0, None, args.fit_start, args.fit_granularity

    def ok(s):
        row = measure(args, c, device, s, 1, True, 1, 0)
        show(row)
        trials.append(row)
        return row["status"] == "ok"

    while hi is None and seq <= args.fit_max and not over_budget():
        lo, hi, seq = (seq, None, seq * 2) if ok(seq) else (lo, seq, seq)
    while hi is not None and hi - lo > g and not over_budget():
        mid = (lo + hi) // 2 // g * g
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if hi is None:  # no failure seen: a lower bound
        return lo, trials, "fit_max" if seq > args.fit_max else "budget"
    return lo, trials, "budget" if hi - lo > g else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a trainer config (its model: section); default small-32k")
    p.add_argument("--shapes", default="8192x4,32768x1,131072x1",
                   help="seq x batch, comma-separated")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default="auto",
                   help="per-block activation checkpointing; auto: on for seq >= 131072")
    p.add_argument("--steps", type=int, default=20, help="timed steps per shape")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (and the compile)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    p.add_argument("--max-seconds", type=float, help="skip the shapes left once this is exceeded")
    p.add_argument("--fit", action="store_true", help="find the longest trainable seq at batch 1")
    p.add_argument("--fit-start", type=int, default=32768)
    p.add_argument("--fit-granularity", type=int, default=8192)
    p.add_argument("--fit-max", type=int, default=1 << 24)
    p.add_argument("--documents", metavar="MU,SIGMA",
                   type=lambda text: tuple(float(x) for x in text.split(",")),
                   help="rows packed with documents of log-normal lengths (natural log mean MU, "
                        "sigma SIGMA, at least 16 tokens): attention causal within each "
                        "document (FlexAttention), RoPE positions restarting at each, no loss "
                        "across a boundary")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", metavar="PREFIX",
                   help="also profile 2 more steps per shape: PREFIX-SEQxBATCH.txt, by kernel")
    args = p.parse_args()
    start = time.perf_counter()
    def over_budget():
        return args.max_seconds is not None and time.perf_counter() - start > args.max_seconds

    c = load_model_config(args.config) if args.config else dict(SMALL_32K)
    c["head_dim"] = c["head_dim"] or c["d_model"] // c["n_heads"]
    if c["head_dim"] % 2 or c["n_heads"] % c["n_kv_heads"]:
        sys.exit("head_dim must be even and n_kv_heads must divide n_heads")
    device = torch.device(args.device)
    params, matmul = counts(c)
    with torch.device("meta"):
        actual = sum(p.numel() for p in Model(c, 1, False).parameters())
    assert actual == params, f"{actual} parameters in the model, {params} by the trainer's list"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}, compile {args.compile}; model {c}")
    print(f"{params} parameters (= ringattn-train's parameter_list), N_matmul {matmul}")
    print(f"FLOPs/token = 6 * N_matmul + 6 * L * n_heads * head_dim * seq = {6 * matmul} + "
          f"{6 * c['n_layers'] * c['n_heads'] * c['head_dim']} * seq; "
          f"peak {args.peak_tflops} TFLOP/s")

    report = dict(gpu=gpu, date=datetime.datetime.now().isoformat(timespec="seconds"),
                  torch=torch.__version__,
                  config=dict(model=c, parameters=params, matmul_parameters=matmul,
                              compile=args.compile, dtype="bf16 autocast", steps=args.steps,
                              warmup=args.warmup, peak_tflops=args.peak_tflops,
                              documents=args.documents,
                              flops_per_token="6 * N_matmul + 12 * L * n_heads * head_dim * "
                                              "keys_per_query (seq / 2 causal; with documents "
                                              "the mean count of keys a query sees)"),
                  results=[])
    if args.fit:
        longest, trials, cut = fit(args, c, device, over_budget)
        report["results"] = trials
        report["fit"] = dict(longest_seq=longest, batch=1, recompute=True, granularity=
                             args.fit_granularity, stopped_early_by=cut)
        print(f"longest trainable seq: {longest}" +
              (f" (stopped early by --{cut.replace('_', '-')}: a lower bound)" if cut else ""))
    else:
        for item in args.shapes.split(","):
            seq, batch = (int(x) for x in item.lower().split("x"))
            recompute = args.recompute == "on" or (args.recompute == "auto" and seq >= 131072)
            if over_budget():
                row = dict(seq=seq, batch=batch, recompute=recompute, step_ms=None,
                           tokens_per_s=None, mfu=None, peak_mib=None, status="skipped")
            else:
                row = measure(args, c, device, seq, batch, recompute, args.steps, args.warmup)
            show(row)
            report["results"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
