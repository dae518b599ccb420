"""Times single backward block calls through the C API: the calls a two-GPU zigzag ring makes at
128k tokens (16 query heads of 128, bf16) against the whole sequence on one GPU, and the unmasked
kernel against the causal one on the same fully visible block.

    python3 bench/backward_calls.py --lib build-gpu/libringattn.so [--json FILE]

Each call adds into fp32 gradients that are not cleared between runs (the time does not depend on
their values); LSE is a constant and delta zero, so the probabilities are small and finite. A
"unit" is 32k x 32k (query, key) pairs: the whole 128k causal problem is 8, each rank's share 4.
Times are medians of CUDA-event timings after two warm-up calls.
"""
import argparse
import ctypes
import json
import math

import torch

from attention import median_ms
from ringattn_ctypes import BackwardParams, Ringattn, describe

K = 1024
HEADS, HEAD_DIM = 16, 128


class Problem:
    """Q, K, V, dO, LSE, delta and fp32 gradients of [batch, seq, heads, 128] on the GPU."""

    def __init__(self, ra, batch, seq, kv_heads):
        self.ra = ra

        def tokens(heads, dtype=torch.bfloat16):
            return torch.randn(batch, seq, heads, HEAD_DIM, device="cuda", dtype=dtype)

        self.q, self.k, self.v, self.do = tokens(HEADS), tokens(kv_heads), tokens(kv_heads), tokens(HEADS)
        self.lse = torch.full((batch, HEADS, seq), 12.0, device="cuda")
        self.delta = torch.zeros(batch, HEADS, seq, device="cuda")
        self.dq = tokens(HEADS, torch.float32)
        self.dk, self.dv = tokens(kv_heads, torch.float32), tokens(kv_heads, torch.float32)

    def call(self, q0, q_len, k0, k_len, causal, q_start=0, k_start=0):
        """A function making one backward call on query rows [q0, q0 + q_len) and key rows
        [k0, k0 + k_len), with the mask's global starts q_start and k_start."""
        rows = slice(q0, q0 + q_len)
        keys = slice(k0, k0 + k_len)
        params = BackwardParams(
            ctypes.sizeof(BackwardParams), describe(self.q[:, rows]), describe(self.k[:, keys]),
            describe(self.v[:, keys]), describe(self.do[:, rows]), describe(self.lse[:, :, rows]),
            describe(self.delta[:, :, rows]), describe(self.dq[:, rows]), describe(self.dk[:, keys]),
            describe(self.dv[:, keys]), 1.0 / math.sqrt(HEAD_DIM), int(causal), 0, q_start, k_start)

        def run():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self.ra._check(self.ra.lib.ringattn_attention_backward(ctypes.byref(params), stream))
        return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    ra = Ringattn(args.lib)
    results = {"gpu": torch.cuda.get_device_name(), "heads": HEADS, "head_dim": HEAD_DIM,
               "dtype": "bf16", "unit": "32k x 32k query-key pairs", "calls": []}

    def measure(kv_heads, name, run, units):
        ms = median_ms(run, warmup=2, repeats=5)
        results["calls"].append({"kv_heads": kv_heads, "call": name, "ms": ms, "ms_per_unit": ms / units})
        print(f"kv {kv_heads:2d}  {name:44s} {ms:9.2f} ms  {ms / units:6.2f} ms/unit", flush=True)
        return ms

    for kv_heads in (16, 4):
        p = Problem(ra, 1, 128 * K, kv_heads)
        t = {}
        # The whole sequence on one GPU, then the calls of a rank holding chunks 0 and 3 of four (the
        # own shard in two row halves, the visiting shard unmasked) and of the rank holding 1 and 2.
        t["whole"] = measure(kv_heads, "whole 128k causal", p.call(0, 128 * K, 0, 128 * K, True), 8)
        t["own1"] = measure(kv_heads, "own shard, rows 0-32k of 64k, causal",
                            p.call(0, 32 * K, 0, 64 * K, True), 0.5)
        t["own2"] = measure(kv_heads, "own shard, rows 32k-64k of 64k, causal",
                            p.call(32 * K, 32 * K, 0, 64 * K, True, 32 * K, 0), 1.5)
        t["visit0"] = measure(kv_heads, "visiting, 32k rows x 64k keys, unmasked",
                              p.call(0, 32 * K, 0, 64 * K, False), 2)
        t["visit1"] = measure(kv_heads, "visiting, 64k rows x 32k keys, unmasked",
                              p.call(0, 64 * K, 0, 32 * K, False), 2)
        # One fully visible 64k x 64k block through both kernels: unmasked, and causal with the
        # queries placed after every key.
        measure(kv_heads, "64k x 64k unmasked", p.call(0, 64 * K, 0, 64 * K, False), 4)
        measure(kv_heads, "64k x 64k causal, all visible", p.call(64 * K, 64 * K, 0, 64 * K, True, 64 * K, 0), 4)
        for rank, visit in ((0, "visit0"), (1, "visit1")):
            share = t["own1"] + t["own2"] + t[visit]
            print(f"kv {kv_heads:2d}  rank {rank}'s calls {share:.2f} ms = {share / (t['whole'] / 2):.3f} x half the whole")
        del p
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
