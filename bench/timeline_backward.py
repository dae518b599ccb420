"""Where the Hopper backward's row-tile steps spend their cycles.

Rewrites a copy of kernels/cuda/flash_backward_sm90.cuh (the file given, in place): clock64()
readings between the phases of each consumer warpgroup's step, summed over the steps, and a printf
of the per-step averages from one CTA (key block 2, head 0, batch 0) of the causal TMA-dQ kernel,
for both warpgroups, on its first two launches. bench/timeline_backward.sh builds such a copy and
runs it. The readings slow the kernel (by about a quarter at 8k tokens): the phases' shares are
what it shows, not the step's length.

    python3 bench/timeline_backward.py COPY/kernels/cuda/flash_backward_sm90.cuh

Phases, in the order a step runs them: mbar (the Q/dO stage's wait), S (issuing S^T and dP^T,
waiting for S^T), P (the probabilities, issuing dV), dP (waiting for dP^T), dS (dS^T, its stores,
the warpgroups' barrier), dQ (issuing dQ and dK, waiting for dQ), stage (dQ's staging and TMA
reduction), dK (waiting for dK), end (the statistics of the next step and the loop).
"""
import sys

PHASES = ["mbar", "S", "P", "dP", "dS", "dQ", "stage", "dK", "end"]


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

    # The consumers' loop (the producer's comes first, with the same header).
    loop = find("for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {",
                find("warpgroup_registers_increase", 0))
    after = {  # line index -> reading inserted after it
        loop: (8, 6),
        find("mbarrier_wait(rows_full + stage", loop): (0, 6),
        find("pin_registers(s);", loop): (1, 6),
        find("add_fragments_times_rows<kHeadDim, kRows>(dv, a_p, do_tile);", loop): (2, 6),
        find("wgmma_wait<1>();  // dP^T", loop): (3, 6),
        find("named_barrier_sync(kDsBarrier, 128 * kGroups);", loop): (4, 10),
        find("wgmma_wait<1>();  // dQ", loop): (5, 8),
    }
    dk = find("wgmma_wait<0>();  // dK", loop)
    after[dk - 1] = (6, 6)
    after[dk] = (7, 6)
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in after:
            phase, indent = after[i]
            text = reading(phase, indent)
            if phase == 8:  # the loop's top: the first step has no loop end before it
                text = text.replace("timeline[8] +=", "if (step > 0) timeline[8] +=")
            out.append(text)
    text = "\n".join(out)

    text = replace_once(text, "namespace ringattn::cuda_detail {",
                        "namespace ringattn::cuda_detail {\n__device__ unsigned timeline_prints = 0;")
    text = replace_once(text, "  warpgroup_registers_increase<Tiles::kConsumerRegisters>();",
                        "  warpgroup_registers_increase<Tiles::kConsumerRegisters>();\n"
                        "  long long timeline_sums[9] = {};")
    text = replace_once(text, "    StepWalk at = first_step;\n    for (int step = 0;",
                        "    long long timeline[9] = {}, timeline_last = clock64();\n"
                        "    StepWalk at = first_step;\n    for (int step = 0;")
    text = replace_once(text, "      if (step + 1 < steps) stage_statistics(step + 1);\n    }\n  }",
                        "      if (step + 1 < steps) stage_statistics(step + 1);\n    }\n"
                        "    for (int k = 0; k < 9; ++k) timeline_sums[k] = timeline[k];\n  }")
    fields = " ".join("%s %%lld" % name for name in PHASES)
    values = ", ".join("timeline_sums[%d] / steps" % k for k in range(9))
    text = replace_once(
        text, "  // The last reductions finish before the CTA's shared memory goes.",
        "  if (kCausal && kTmaDq && threadIdx.x % 128 == 0 && warp_group < kGroups && steps > 0 &&\n"
        "      blockIdx.x == 2 && blockIdx.y == 0 && blockIdx.z == 0 &&\n"
        "      atomicAdd(&timeline_prints, 1u) < 4u) {\n"
        "    printf(\"timeline warpgroup %d, %d steps, cycles a step: " + fields + "\\n\",\n"
        "           warp_group, steps, " + values + ");\n"
        "  }\n"
        "  // The last reductions finish before the CTA's shared memory goes.")
    open(path, "w").write(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
