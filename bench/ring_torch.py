"""PyTorch's own ring attention on the shapes of `ringattn-bench ring`, for bench/ring.sh.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/ring_torch.py \\
        --out ring_torch.json [--seqlens 32768,131072,524288] [--causal both|on|off] \\
        [--max-full-seq S] [--backend auto|cudnn|flash] [--rotate alltoall[,allgather]]

torch.distributed.tensor.experimental.context_parallel: every rank makes the whole sequence's
q, k, v and dO [1, heads, S, head_dim] bf16 (one seed, so the same values everywhere), the context
shards them along the sequence in place, and scaled_dot_product_attention inside it runs as ring
attention over the ranks. Under the causal mask the shards are the load-balanced head-tail halves
(rank r holds chunks r and 2N-1-r, ringattn's zigzag); without a mask context_parallel refuses its
load balancing, so the shards are contiguous. set_rotate_method picks how K/V travel: "alltoall"
passes them around the ring step by step (ringattn's schedule), "allgather" gathers them all at
once; dK/dV always travel around the ring. The SDPA backend is cuDNN, else flash (--backend auto:
the first that runs a short sequence of each mask).

Timing as in ringattn-bench ring: each run is a forward (SDPA) then a backward
(torch.autograd.grad of the output with dO), CUDA events around both, every rank entering a
barrier before each run, a run counting its slowest rank, medians over the runs (5 below 128k
tokens, 3 below 512k, 2 from 512k, after one warm-up run below 512k). TFLOP/s per GPU:
4*b*h*s^2*d forward for the whole sequence, halved when causal, backward 2.5x, divided by the
GPUs. A configuration that runs out of memory, or that the backend refuses, is recorded with its
error and the next one runs; the JSON is rewritten after every configuration.
"""
import argparse
import contextlib
import datetime
import importlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def cp_module():
    """The module that holds context_parallel's options and set_rotate_method (where it lives
    depends on the torch version)."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_cp_options") and hasattr(module, "set_rotate_method"):
            return module
    raise RuntimeError(f"torch {torch.__version__} has no context_parallel options to set")


def nccl_version():
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def default_repeats(seq):
    return 5 if seq < 131072 else 3 if seq < 524288 else 2


def default_warmup(seq):
    return 1 if seq < 524288 else 0


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def median_phases_ms(body, count, warmup, repeats):
    """body(mark) runs `warmup` times untimed, then `repeats` times between CUDA events; mark()
    ends each of its `count` phases but the last. Returns the median of each phase and, last, of
    the whole run, each run's figure the largest over the ranks."""
    for _ in range(warmup):
        body(lambda: None)
    rows = []
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        inner = iter(events[1:-1])
        torch.cuda.synchronize()
        dist.barrier()
        events[0].record()
        body(lambda: next(inner).record())
        events[-1].record()
        events[-1].synchronize()
        rows.append([events[i].elapsed_time(events[i + 1]) for i in range(count)]
                    + [events[0].elapsed_time(events[-1])])
    times = torch.tensor(rows, dtype=torch.float64, device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [median(times[:, c].tolist()) for c in range(count + 1)]


@contextlib.contextmanager
def ring_context(mesh, buffers):
    """context_parallel over `buffers` (sharded in place along dim 2, not restored), left through
    its normal exit even when the body raises, so that SDPA is always un-patched again."""
    ctx = context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers),
                           no_restore_buffers=set(buffers))
    ctx.__enter__()
    try:
        yield
    finally:
        ctx.__exit__(None, None, None)


def time_config(mesh, cp, args, seq, causal, backend, rotate, warmup, repeats):
    """Forward, backward and forward+backward medians (ms) of one configuration, and the memory
    the runs allocate beyond the inputs, the largest over the ranks (GiB; context_parallel shrinks
    the inputs to their shards in place, which keeps their whole storage, so this leaves it out)."""
    cp.set_rotate_method(rotate)
    cp._cp_options.enable_load_balance = causal
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seq * 7 + int(causal))
    shape = (1, args.heads, seq, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
                     for _ in range(4))
    with sdpa_kernel([BACKENDS[backend]]), ring_context(mesh, [q, k, v, dout]):
        for t in (q, k, v):
            t.requires_grad_(True)
        torch.cuda.synchronize()
        inputs = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

        def run(mark):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            mark()
            torch.autograd.grad(out, (q, k, v), dout)

        ms = median_phases_ms(run, 2, warmup, repeats)
    work = torch.tensor([(torch.cuda.max_memory_allocated() - inputs) / 2**30], dtype=torch.float64,
                        device="cuda")
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    return ms, work.item()


def attempt(mesh, cp, args, seq, causal, backend, rotate, warmup, repeats):
    """time_config, or the error that stopped it on any rank; every rank returns the same."""
    result, error = None, ""
    try:
        result = time_config(mesh, cp, args, seq, causal, backend, rotate, warmup, repeats)
    except torch.cuda.OutOfMemoryError as e:
        error = "out of memory: " + str(e).splitlines()[0]
    except (RuntimeError, NotImplementedError, ValueError, AssertionError) as e:
        error = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    return (None, "; ".join(failed)) if failed else (result, "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="32768,131072,524288")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("--max-full-seq", type=int, default=0,
                        help="time the full (non-causal) mask only up to this length")
    parser.add_argument("--backend", choices=("auto", "cudnn", "flash"), default="auto")
    parser.add_argument("--rotate", default="alltoall", help="alltoall, allgather or both, comma-separated")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs (default: by length)")
    parser.add_argument("--warmup", type=int, default=-1, help="untimed runs first (default: by length)")
    parser.add_argument("--timeout", type=int, default=120,
                        help="seconds a collective may wait before the job fails instead of hanging")
    parser.add_argument("--revision", default=os.environ.get("RINGATTN_REVISION", "unknown"))
    parser.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    cp = cp_module()

    seqlens = [int(s) for s in args.seqlens.split(",")]
    masks = [m for m, wanted in ((True, args.causal != "off"), (False, args.causal != "on")) if wanted]
    rotates = [r.strip() for r in args.rotate.split(",") if r.strip()]
    for seq in seqlens:
        if seq % (2 * world):
            parser.error(f"sequence length {seq} is not a multiple of {2 * world} (2 x ranks)")

    # The backend of each mask: the first of the preference that runs a short sequence.
    short = 4096 * world
    preference = ["cudnn", "flash"] if args.backend == "auto" else [args.backend]
    backend_of, refused = {}, {}
    for causal in masks:
        for backend in preference:
            _, error = attempt(mesh, cp, args, short, causal, backend, rotates[0], 1, 1)
            if not error:
                backend_of[causal] = backend
                break
            refused[f"{backend} {'causal' if causal else 'full'}"] = error
            if rank == 0:
                print(f"ring_torch: {backend} refuses the {'causal' if causal else 'full'} mask: {error}",
                      file=sys.stderr)

    result = dict(benchmark="ring_torch", gpu=torch.cuda.get_device_name(), gpus=world,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  revision=args.revision, torch=torch.__version__,
                  cudnn=torch.backends.cudnn.version(), nccl=nccl_version(),
                  configuration=dict(
                      dtype="bf16", batch=1, heads=args.heads, head_dim=args.head_dim,
                      api="torch.distributed.tensor.experimental.context_parallel",
                      layout="head-tail halves (load-balanced) when causal, contiguous otherwise",
                      flops="4*b*h*s^2*d forward over the whole sequence (half when causal), backward 2.5x; "
                            "per GPU: divided by gpus",
                      timing="CUDA events, forward then torch.autograd.grad in each run, median over the "
                             "runs; every rank enters a barrier before each run and a run counts its "
                             "slowest rank"),
                  refused=refused, rows=[])

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if rank == 0:
        write()
        print(f"ring_torch: {world} x {result['gpu']}, torch {torch.__version__}, bf16, batch 1, "
              f"{args.heads} heads of {args.head_dim}")
        print(f"{'seq':>8} {'mask':6} {'backend':7} {'rotate':9} | {'fwd ms':>9} {'bwd ms':>9} {'f+b ms':>9} | "
              f"{'TFLOP/s a GPU fwd/bwd/f+b':>25} | {'work GiB':>8}")
        sys.stdout.flush()
    for seq in seqlens:
        for causal in masks:
            if not causal and args.max_full_seq and seq > args.max_full_seq:
                continue
            for rotate in rotates:
                repeats = args.repeats or default_repeats(seq)
                warmup = args.warmup if args.warmup >= 0 else default_warmup(seq)
                backend = backend_of.get(causal)
                row = dict(seq=seq, tokens_per_gpu=seq // world, heads=args.heads, kv_heads=args.heads,
                           head_dim=args.head_dim, causal=causal, backend=backend, rotate_method=rotate,
                           repeats=repeats, warmup=warmup, forward_ms=None, backward_ms=None, total_ms=None,
                           forward_tflops_per_gpu=None, backward_tflops_per_gpu=None,
                           total_tflops_per_gpu=None, work_memory_gib=None, error=None)
                if backend is None:
                    row["error"] = "no backend runs this mask (see refused)"
                else:
                    timed, error = attempt(mesh, cp, args, seq, causal, backend, rotate, warmup, repeats)
                    if error:
                        row["error"] = error
                    else:
                        (fwd, bwd, total), work = timed
                        flop = 4.0 * args.heads * seq * seq * args.head_dim * (0.5 if causal else 1.0)
                        row.update(forward_ms=fwd, backward_ms=bwd, total_ms=total,
                                   forward_tflops_per_gpu=flop / world / (fwd * 1e-3) / 1e12,
                                   backward_tflops_per_gpu=2.5 * flop / world / (bwd * 1e-3) / 1e12,
                                   total_tflops_per_gpu=3.5 * flop / world / (total * 1e-3) / 1e12,
                                   work_memory_gib=work)
                result["rows"].append(row)
                if rank == 0:
                    def fmt(x, spec, width=0):
                        return ("-" if x is None else format(x, spec)).rjust(width)
                    tf = "/".join(fmt(row[f"{p}_tflops_per_gpu"], ".0f") for p in ("forward", "backward", "total"))
                    print(f"{seq:8d} {'causal' if causal else 'full':6} {backend or '-':7} {rotate:9} | "
                          f"{fmt(row['forward_ms'], '.2f', 9)} {fmt(row['backward_ms'], '.2f', 9)} "
                          f"{fmt(row['total_ms'], '.1f', 9)} | {tf:>25} | {fmt(row['work_memory_gib'], '.1f', 8)}")
                    if row["error"]:
                        print(f"    {row['error']}")
                    sys.stdout.flush()
                    write()
    if rank == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
