"""bench/timeline_backward.py against today's Hopper backward: applied to a copy of
kernels/cuda/flash_backward_sm90.cuh it must put one clock64() reading of each phase into the
consumers' step loop, in the step's order, with the sums and the printf after the loop; applied to
a copy missing a phase's line it must stop with a message naming that line, not write a kernel
without the reading. (That the instrumented copy compiles is for the GPU machine's
bench/timeline_backward.sh.)

  python3 tests/tools/bench_timeline_backward.py bench/timeline_backward.py
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

from known_answers import Failures


def main(script):
    kernel = os.path.join(os.path.dirname(os.path.abspath(script)), "..", "kernels", "cuda",
                          "flash_backward_sm90.cuh")
    failures = Failures()
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "flash_backward_sm90.cuh")
        shutil.copy(kernel, copy)
        r = subprocess.run([sys.executable, script, copy], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"on today's kernel: exit {r.returncode}, {r.stdout}{r.stderr}")
            return failures.report("bench/timeline_backward.py")
        text = open(copy).read()
        phases = re.findall(r"timeline\[(\d+)\] \+= now - timeline_last", text)
        if len(phases) < 2 or sorted(set(phases)) != sorted(phases):
            failures.append(f"phase readings {phases}: expected each phase once")
        # In the step's order: the loop's top (the last phase) first, then 0, 1, 2 ...
        want = [str(len(phases) - 1)] + [str(k) for k in range(len(phases) - 1)]
        if phases != want:
            failures.append(f"phase readings in the order {phases} (expected {want})")
        loop = text.find("long long timeline[")
        sums = text.find("timeline_sums[k] = timeline[k]")
        printed = text.find('printf("timeline warpgroup')
        if not 0 < loop < sums < printed:
            failures.append(f"the loop's counters, sums and printf at {loop}, {sums}, {printed} "
                            "(expected in that order)")
        # A kernel whose dP^T wait reads otherwise: the script names the line it looked for.
        shutil.copy(kernel, copy)
        original = open(copy).read()
        open(copy, "w").write(original.replace("wgmma_wait<1>();  // dP^T", "wgmma_wait<1>();"))
        r = subprocess.run([sys.executable, script, copy], capture_output=True, text=True)
        if r.returncode == 0 or "dP^T" not in r.stdout + r.stderr:
            failures.append(f"a kernel without the dP^T wait's line: exit {r.returncode}, "
                            f"{(r.stdout + r.stderr).strip()!r} (expected a failure naming it)")
        if open(copy).read() != original.replace("wgmma_wait<1>();  // dP^T", "wgmma_wait<1>();"):
            failures.append("a kernel the script refused was written anyway")
    return failures.report("bench/timeline_backward.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
