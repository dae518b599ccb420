"""Where the Hopper backward's row-tile steps spend their cycles.

Rewrites a copy of kernels/cuda/flash_backward_sm90.cuh (the file given, in place): clock64()
readings between the phases of each consumer warpgroup's step, summed over the steps, and a printf
of the per-step averages from one CTA (key block 2, head 0, batch 0) of the causal TMA-dQ kernel,
for both warpgroups, on its first two launches. bench/timeline_backward.sh builds such a copy and
runs it. The readings slow the kernel (by about a quarter at 8k tokens): the phases' shares are
what it shows, not the step's length.

    python3 bench/timeline_backward.py COPY/kernels/cuda/flash_backward_sm90.cuh

Phases, in the order a step runs them: mbar (the Q/dO stage's wait), dSbuf (the wait for the dQ
warpgroup to free this step's dS^T buffer), S (issuing S^T and dP^T, waiting for S^T), P (the
probabilities, issuing dV), dP (waiting for dP^T), dS (dS^T, its stores for the dQ warpgroup and
their arrival), dK (issuing dK), stats (the next step's statistics), wait (waiting for dK and dV),
end (the stage's release and the loop). dQ runs on the third warpgroup, outside these readings.
"""
import sys

# (phase, a fragment of the line the reading follows, the reading's indent), in the step's order.
PHASES = [
    ("mbar", "mbarrier_wait(rows_full + stage", 6),
    ("dSbuf", "mbarrier_wait(ds_empty + ds_buffer", 6),
    ("S", "pin_registers(s);", 6),
    ("P", "add_fragments_times_rows<kWidth, kRows>(dv, a_p, do_tile);", 6),
    ("dP", "wgmma_wait<1>();  // dP^T", 6),
    ("dS", "if (lane == 0) mbarrier_arrive(ds_full + ds_buffer);", 8),
    ("dK", "add_fragments_times_rows<kWidth, kRows>(dk, a_ds, q_tile);", 6),
    ("stats", "if (step + 1 < steps) stage_statistics(step + 1);", 6),
    ("wait", "wgmma_wait<0>();  // dK", 6),
]
END = len(PHASES)  # the loop's top: the time since the last reading of the step before


def reading(phase, indent):
    return (" " * indent + "{ const long long now = clock64(); timeline[%d] += now - timeline_last; "
            "timeline_last = now; }" % phase)


def replace_once(text, old, new):
    if text.count(old) != 1:
        raise SystemExit("timeline_backward: the kernel no longer has exactly one %r" % old.strip())
    return text.replace(old, new)


def main(path):
    lines = open(path).read().split("\n")

    def find(fragment, start):
        for i in range(start, len(lines)):
            if fragment in lines[i]:
                return i
        raise SystemExit("timeline_backward: not found after line %d: %r" % (start, fragment))

    # The consumers' loop (the copying warpgroup's comes first, with the same header).
    consumers = find("warpgroup_registers_increase<kConsumerRegisters>();", 0)
    loop = find("for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {", consumers)
    after = {loop: (END, 6)}  # line index -> reading inserted after it
    at = loop
    for phase, (_, fragment, indent) in enumerate(PHASES):
        at = find(fragment, at)
        if phase == 1:  # the dS^T buffer's wait: after its if constexpr block
            at += 1
        after[at] = (phase, indent)
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in after:
            phase, indent = after[i]
            text = reading(phase, indent)
            if phase == END:  # the first step has no step before it
                text = text.replace("timeline[%d] +=" % END, "if (step > 0) timeline[%d] +=" % END)
            out.append(text)
    text = "\n".join(out)
    count = len(PHASES) + 1

    text = replace_once(text, "namespace ringattn::cuda_detail {",
                        "namespace ringattn::cuda_detail {\n__device__ unsigned timeline_prints = 0;")
    text = replace_once(text, "  warpgroup_registers_increase<kConsumerRegisters>();",
                        "  warpgroup_registers_increase<kConsumerRegisters>();\n"
                        "  long long timeline_sums[%d] = {};" % count)
    text = replace_once(text, "    StepWalk at = first_step;\n    for (int step = 0; step < steps; ++step, "
                        "at.advance(row_tiles)) {\n" + reading(END, 6).replace(
                            "timeline[%d] +=" % END, "if (step > 0) timeline[%d] +=" % END),
                        "    long long timeline[%d] = {}, timeline_last = clock64();\n"
                        "    StepWalk at = first_step;\n    for (int step = 0; step < steps; ++step, "
                        "at.advance(row_tiles)) {\n" % count + reading(END, 6).replace(
                            "timeline[%d] +=" % END, "if (step > 0) timeline[%d] +=" % END))
    text = replace_once(text, "      if (lane == 0) mbarrier_arrive(rows_empty + stage);\n    }\n  }",
                        "      if (lane == 0) mbarrier_arrive(rows_empty + stage);\n    }\n"
                        "    for (int k = 0; k < %d; ++k) timeline_sums[k] = timeline[k];\n  }" % count)
    names = [name for name, _, _ in PHASES] + ["end"]
    fields = " ".join("%s %%lld" % name for name in names)
    values = ", ".join("timeline_sums[%d] / steps" % k for k in range(count))
    text = replace_once(
        text, "  // A CTA with no rows (keys after every query, or an empty part of a split) has nothing",
        "  if (kCausal && kTmaDq && threadIdx.x % 128 == 0 && steps > 0 &&\n"
        "      blockIdx.x == 2 && blockIdx.y == 0 && blockIdx.z == 0 &&\n"
        "      atomicAdd(&timeline_prints, 1u) < 4u) {\n"
        "    printf(\"timeline warpgroup %d, %d steps, cycles a step: " + fields + "\\n\",\n"
        "           warp_group, steps, " + values + ");\n"
        "  }\n"
        "  // A CTA with no rows (keys after every query, or an empty part of a split) has nothing")
    open(path, "w").write(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
