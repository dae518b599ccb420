"""bench/schedule_model.py against grids whose answer is known by construction: the launch order
of causal_grid_place (a partial group first, then whole groups, the blocks of a group interleaved
over its pairs) for every group size, every CTA placed once; the greedy grid time of equal CTAs
(whole waves) and of one long CTA launched first or last; and each block's steps without
documents (causal: a backward key block of 128 sees the rows from its first key on, a forward row
block of 128 the keys up to its last row) and with one document boundary.

  python3 tests/tools/bench_schedule_model.py bench/schedule_model.py
"""
import importlib.util
import math
import sys

from known_answers import Failures


def main(script):
    spec = importlib.util.spec_from_file_location("schedule_model", script)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    failures = Failures()

    # causal_grid_place: blocks 3, pairs 5, group 2 -> pair 0 alone first (its blocks in order),
    # then pairs 1-2 interleaved, then pairs 3-4.
    order = [model.place(3, 5, 2, i) for i in range(15)]
    want = [(0, 0), (1, 0), (2, 0),
            (0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2),
            (0, 3), (0, 4), (1, 3), (1, 4), (2, 3), (2, 4)]
    if order != want:
        failures.append(f"place(3, 5, 2, i): {order} (expected {want})")
    for group in (1, 2, 3, 4, 5):
        placed = sorted(model.place(4, 5, group, i) for i in range(20))
        if placed != [(b, p) for b in range(4) for p in range(5)]:
            failures.append(f"place(4, 5, {group}, i) does not place every CTA once")

    failures.check("264 equal CTAs on 132 SMs", model.grid_time([1.0] * 264, 132), 2.0)
    failures.check("265 equal CTAs on 132 SMs", model.grid_time([1.0] * 265, 132), 3.0)
    # One CTA of 10 and 20 of 1 on 4 SMs: first, it runs alone while the rest fill the others in
    # 20 / 3 -> 7 waves; last, it starts after the 20 (5 waves).
    failures.check("the long CTA first", model.grid_time([10.0] + [1.0] * 20, 4), 10.0)
    failures.check("the long CTA last", model.grid_time([1.0] * 20 + [10.0], 4), 15.0)

    seq = 1024
    backward, forward = model.block_work(seq, [])
    for b in range(seq // 128):
        failures.check(f"backward block {b}, one document", backward[b],
                       math.ceil(seq / 64) - (b * 128) // 64 + 2)
        row_block = seq // 128 - 1 - b  # launch order: the last rows first
        failures.check(f"forward block {b}, one document", forward[b], row_block + 1 + 2)
    # A boundary at 300: key block 0 (keys 0-127) sees rows up to 300, block 2 (256-383) rows from
    # 256 to the end; row block 2 (rows 256-383) sees key tiles 0-2, row block 3 (384-511) tiles 2-3.
    backward, forward = model.block_work(seq, [300])
    failures.check("backward block 0 before a boundary at 300", backward[0], math.ceil(300 / 64) + 2)
    failures.check("backward block 2 across it", backward[2], math.ceil(seq / 64) - 4 + 2)
    failures.check("forward row block 2 across it", forward[seq // 128 - 1 - 2], 3 + 2)
    failures.check("forward row block 3 after it", forward[seq // 128 - 1 - 3], 2 + 2)

    # tile_account: causal over 256 tokens, one document: row blocks see 1 and 2 key tiles, key
    # blocks walk 4 and 2 row steps; its 256 * 257 / 2 = 32896 visible pairs fill 3 tiles of
    # 128 x 128 and 6 steps of 64 x 128. Documents [0, 128) and [128, 256): one tile a row block,
    # two steps a key block, 2 * 128 * 129 / 2 = 16512 visible pairs.
    for label, starts, visible, want in (
            ("one document", [], 32896, (1.5, 32896 / (3 * 16384), 3.0, 32896 / (6 * 8192))),
            ("two documents", [128], 16512, (1.0, 16512 / (2 * 16384), 2.0, 16512 / (4 * 8192)))):
        got = model.tile_account(256, starts, visible)
        for name, g, w in zip(("forward tiles", "their share", "backward steps", "their share"),
                              got, want):
            failures.check(f"tile_account(256), {label}: {name}", g, w)
    return failures.report("bench/schedule_model.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
