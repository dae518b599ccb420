"""The tail of a causal Hopper grid under packed documents, by a scheduling model: each CTA costs
its steps (the row tiles of 64 a backward key block of 128 walks, the key tiles of 128 a forward
row block of 128 walks) plus two for its prologue and epilogue; the CTAs start in launch order
(causal_grid_place with a group of 1, 2, 4 ... pairs) on the multiprocessors, one each, as soon as
one is free. The figure is the grid's time over its work spread evenly (1.000: no tail), beside
the longest-first order over every CTA. The documents of bench/masks.py (log-normal lengths,
sigma 1, seed 1), as drawn and mirrored (the longest blocks late, then early). Then what a CTA
computes under those documents against causal sequences of one document (tile_account).

    python3 bench/schedule_model.py [--seq 32768] [--heads 16] [--sms 132]
"""
import argparse
import bisect
import heapq
import itertools
import math


def grid_time(costs, sms):
    free = [0.0] * sms
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def place(blocks, pairs, group, index):
    """causal_grid_place: (order, pair) of the CTA launched index-th."""
    front = pairs % group
    at, members, pair0 = index, front, 0
    if at >= front * blocks:
        at -= front * blocks
        g = at // (group * blocks)
        at -= g * group * blocks
        members, pair0 = group, front + g * group
    return at // members, pair0 + at % members


def block_work(seq, starts):
    """Steps of each backward key block (in key order) and forward row block (last rows first)."""
    firsts = [0] + starts

    def document_end(p):
        i = bisect.bisect_right(starts, p)
        return starts[i] if i < len(starts) else seq

    def document_start(p):
        return firsts[bisect.bisect_right(firsts, p) - 1]

    blocks = seq // 128
    backward = [math.ceil(document_end(b * 128 + 127) / 64) - (b * 128) // 64 + 2
                for b in range(blocks)]
    forward = []
    for i in range(blocks):
        row0 = (blocks - 1 - i) * 128
        forward.append((row0 + 127) // 128 - document_start(row0) // 128 + 1 + 2)
    return backward, forward


def tile_account(seq, starts, visible):
    """What a CTA computes under causal documents (seq a multiple of 128): the mean key tiles of
    128 a forward row block of 128 visits and the mean row steps of 64 a backward key block of 128
    walks (block_work's, without its prologue and epilogue), each with the share of the pairs in
    those tiles that the mask lets through (`visible` of them: bench/masks.py's visible_pairs)."""
    backward, forward = block_work(seq, starts)
    tiles, steps = [w - 2 for w in forward], [w - 2 for w in backward]
    return (sum(tiles) / len(tiles), visible / (sum(tiles) * 128 * 128),
            sum(steps) / len(steps), visible / (sum(steps) * 64 * 128))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    # bench/masks.py's documents, the same draw, and its count of visible pairs (needs torch)
    from masks import lognormal_starts, visible_pairs
    groups = [g for g in (1, 2, 4, 8, 16, 32, 64) if g < args.heads] + [args.heads]
    print(f"{args.seq} tokens, {args.heads} pairs, {args.sms} SMs; grid time / even spread")
    print("mean  order     pass      " + "  ".join(f"group {g:<3d}" for g in groups) +
          "  longest first")
    for mean, mirrored in itertools.product((2048, 8192), (False, True)):
        starts = lognormal_starts(args.seq, mean, 1)
        if mirrored:
            lengths = [b - a for a, b in zip([0] + starts, starts + [args.seq])][::-1]
            starts = list(itertools.accumulate(lengths))[:-1]
        for name, work in zip(("backward", "forward"), block_work(args.seq, starts)):
            blocks, even = len(work), sum(work) * args.heads / args.sms
            cells = []
            for group in groups:
                costs = [work[place(blocks, args.heads, group, i)[0]]
                         for i in range(blocks * args.heads)]
                cells.append(grid_time(costs, args.sms) / even)
            best = grid_time(sorted((w for w in work for _ in range(args.heads)), reverse=True),
                             args.sms) / even
            print(f"{mean:<5d} {'mirrored' if mirrored else 'as drawn':9s} {name:9s} " +
                  "  ".join(f"{c:9.3f}" for c in cells) + f"  {best:9.3f}")
    # A CTA's length under documents beside causal sequences of one document, whose measured
    # rates at those lengths set the documents' rate in context.
    print("\nper CTA: forward key tiles (visible share of their pairs), backward row steps (share)")
    cases = [(f"documents, mean {mean}", args.seq, lognormal_starts(args.seq, mean, 1))
             for mean in (2048, 8192)]
    cases += [(f"causal {n // 1024}k, one document", n, []) for n in (2048, 8192, args.seq)]
    for label, n, starts in cases:
        tiles, tile_share, steps, step_share = tile_account(
            n, starts, visible_pairs(n, True, 0, starts))
        print(f"{label:28s} forward {tiles:6.1f} ({tile_share:.3f})  backward {steps:6.1f} "
              f"({step_share:.3f})")


if __name__ == "__main__":
    main()
