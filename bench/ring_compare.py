"""ringattn's ring against PyTorch's context_parallel, configuration by configuration.

    python3 bench/ring_compare.py OUTDIR/ring.json OUTDIR/ring_torch.json --out OUTDIR/ring_compare.json

Pairs the rows of `ringattn-bench ring` (ring.json) with those of bench/ring_torch.py
(ring_torch.json) by sequence length and mask, for ringattn's rows with as many K/V heads as query
heads (the torch side runs no GQA). For the forward, the backward and the two together: both times
and both TFLOP/s per GPU, and ratio = ringattn TFLOP/s / torch TFLOP/s = torch time / ringattn time
(above 1: ringattn is faster). ringattn's efficiency and hidden share come along for reading.
Prints a table and writes the rows as JSON; exits 1 when an input is missing or unreadable (after
writing what it could).
"""
import argparse
import json
import sys

PHASES = ("forward", "backward", "total")


def load(path):
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as error:
        return None, f"{path}: {error}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ringattn", help="ring.json of ringattn-bench ring")
    parser.add_argument("torch", help="ring_torch.json of bench/ring_torch.py")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    mine, mine_error = load(args.ringattn)
    theirs, theirs_error = load(args.torch)
    problems = [e for e in (mine_error, theirs_error) if e]
    torch_rows = {}
    for row in (theirs or {}).get("rows", []):
        torch_rows.setdefault((row["seq"], row["causal"]), []).append(row)

    rows = []
    for r in (mine or {}).get("rows", []):
        if r["kv_heads"] != r["heads"]:
            continue
        for t in torch_rows.get((r["seq"], r["causal"]), [None]):
            row = dict(seq=r["seq"], causal=r["causal"], heads=r["heads"], head_dim=r["head_dim"],
                       torch_backend=t and t.get("backend"), torch_rotate_method=t and t.get("rotate_method"))
            for phase in PHASES:
                mine_ms, torch_ms = r.get(f"ring_{phase}_ms"), t and t.get(f"{phase}_ms")
                row[f"ringattn_{phase}_ms"] = mine_ms
                row[f"torch_{phase}_ms"] = torch_ms
                row[f"ringattn_{phase}_tflops_per_gpu"] = r.get(f"{phase}_tflops_per_gpu")
                row[f"torch_{phase}_tflops_per_gpu"] = t and t.get(f"{phase}_tflops_per_gpu")
                row[f"ratio_{phase}"] = torch_ms / mine_ms if mine_ms and torch_ms else None
            row["ringattn_efficiency_total"] = r.get("efficiency_total")
            row["ringattn_hidden_total"] = r.get("hidden_total")
            row["ringattn_error"] = r.get("error")
            row["torch_error"] = (t.get("error") if t else "no torch row for this configuration")
            rows.append(row)

    result = dict(benchmark="ring_compare", ratio="ringattn TFLOP/s / torch TFLOP/s (torch time / ringattn time)",
                  gpu=(mine or theirs or {}).get("gpu"), gpus=(mine or theirs or {}).get("gpus"),
                  ringattn_revision=(mine or {}).get("revision"), torch=(theirs or {}).get("torch"),
                  problems=problems, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nring attention, ringattn / torch context_parallel ({result['gpus']} x {result['gpu']})")
    print(f"{'seq':>8} {'mask':6} {'torch':14} | {'ringattn TF/s fwd/bwd/f+b':>25} | "
          f"{'torch TF/s fwd/bwd/f+b':>22} | {'ratio fwd/bwd/f+b':>17}")
    for row in rows:
        torch_name = f"{row['torch_backend'] or '-'} {row['torch_rotate_method'] or ''}".strip()
        mine_tf = "/".join(fmt(row[f"ringattn_{p}_tflops_per_gpu"], ".0f") for p in PHASES)
        torch_tf = "/".join(fmt(row[f"torch_{p}_tflops_per_gpu"], ".0f") for p in PHASES)
        ratios = "/".join(fmt(row[f"ratio_{p}"], ".2f") for p in PHASES)
        print(f"{row['seq']:8d} {'causal' if row['causal'] else 'full':6} {torch_name:14} | {mine_tf:>25} | "
              f"{torch_tf:>22} | {ratios:>17}")
    for problem in problems:
        print(f"ring_compare: {problem}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
