"""Windows and documents at long sequence lengths: ringattn (both kernel families) and
FlexAttention against an fp32 reference on sampled rows, one GPU.

The kernels' tests check masks against the fp64 oracle at a few hundred tokens; this checks the
same masks where a row's keys span dozens of tiles. For each mask and sampled query rows (the
first and last of the sequence, rows around every multiple of the window, random rows), the
reference is plain fp32 attention of those rows over every key with the mask written from its
definition; O and dQ (for dO random) of each implementation are compared with it. Prints the max
|error| of each; exits 1 when ringattn's exceeds twice the larger of FlexAttention's and the same
rows' bf16 rounding of O (2^-8 max|O|).

    python3 bench/masks_check.py [--seq 32768] [--window 4096]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import ringattn  # noqa: E402
from masks import flex_mask_mod, lognormal_starts  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dims", default="128,64,96")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--doc-mean", type=int, default=2048)
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    seq, heads, window = args.seq, args.heads, args.window
    starts = lognormal_starts(seq, args.doc_mean, 1)
    doc_id = torch.zeros(seq, dtype=torch.int64)
    if starts:
        doc_id[torch.tensor(starts)] = 1
        doc_id = doc_id.cumsum(0)
    doc_id = doc_id.cuda()
    starts_t = torch.tensor(starts, dtype=torch.int64, device="cuda")
    gen = torch.Generator().manual_seed(3)
    rows = sorted(set([0, 1, seq - 1, seq - 2] +
                      [m + o for m in range(window, seq, window) for o in (-129, -128, -1, 0, 1, 127, 128)
                       if 0 <= m + o < seq] +
                      torch.randint(0, seq, (256,), generator=gen).tolist()))
    rows_t = torch.tensor(rows, device="cuda")
    failed = False
    for d in [int(x) for x in args.head_dims.split(",")]:
        q, k, v, do = (torch.randn(1, seq, heads, d, generator=gen).cuda().bfloat16() for _ in range(4))
        for name, win, docs in [("causal", 0, False), (f"window {window}", window, False),
                                ("documents", 0, True), (f"documents + window {window}", window, True)]:
            # The reference on the sampled rows, fp32, mask from the definition.
            i = rows_t[:, None]
            j = torch.arange(seq, device="cuda")[None, :]
            keep = j <= i
            if win:
                keep &= (i - j) < win
            if docs:
                keep &= doc_id[i] == doc_id[j]
            qf, kf, vf, dof = (x[0].float().transpose(0, 1) for x in (q, k, v, do))  # [H, S, D]
            scale = 1.0 / math.sqrt(d)
            s = (qf[:, rows_t] @ kf.transpose(1, 2)) * scale
            s = s.masked_fill(~keep[None], float("-inf"))
            p = torch.softmax(s, dim=-1)
            o_ref = p @ vf                                            # [H, R, D]
            dp = dof[:, rows_t] @ vf.transpose(1, 2)
            delta = (dof[:, rows_t] * o_ref).sum(-1, keepdim=True)
            dq_ref = ((p * (dp - delta)) @ kf) * scale
            del s, p, dp

            def errors(o, dq):
                o_rows = o[0].float().transpose(0, 1)[:, rows_t]
                dq_rows = dq[0].float().transpose(0, 1)[:, rows_t]
                o_err = (o_rows - o_ref).abs().amax(dim=(0, 2))  # per sampled row
                worst = rows[int(o_err.argmax())]
                return o_err.max().item(), (dq_rows - dq_ref).abs().max().item(), worst

            results = {}
            for family in ("default", "sm80"):
                if family == "sm80":
                    os.environ["RINGATTN_FLASH_FAMILY"] = "sm80"
                qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
                o = ringattn.attention(qr, kr, vr, causal=True, window=(win, None) if win else None,
                                       document_starts=starts_t if docs else None)
                o.backward(do)
                results[f"ringattn {family}"] = errors(o.detach(), qr.grad)
                os.environ.pop("RINGATTN_FLASH_FAMILY", None)

            torch._dynamo.reset()
            block_mask = create_block_mask(flex_mask_mod(win, doc_id if docs else None), None,
                                           None, seq, seq, device="cuda")
            qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            o = torch.compile(flex_attention)(qt, kt, vt, block_mask=block_mask)
            o.backward(do.transpose(1, 2))
            results["flex"] = errors(o.detach().transpose(1, 2), qt.grad.transpose(1, 2))
            rounding = 2.0 ** -8 * o_ref.abs().max().item()
            bound_o = 2 * max(results["flex"][0], rounding)
            bound_dq = 2 * max(results["flex"][1], 2.0 ** -8 * dq_ref.abs().max().item())
            line = ", ".join(f"{k}: O {e[0]:.2e} (row {e[2]}) dQ {e[1]:.2e}" for k, e in results.items())
            bad = [k for k in results if k != "flex" and
                   (results[k][0] > bound_o or results[k][1] > bound_dq)]
            print(f"d {d:3d} {name:28} {line}{'   FAILED: ' + ', '.join(bad) if bad else ''}")
            sys.stdout.flush()
            failed = failed or bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
