#!/usr/bin/env bash
# Where the Hopper backward's steps spend their cycles (bf16, d 128, causal, TMA dQ): builds a copy
# of the tree with bench/timeline_backward.py's clock64() readings in the kernel and runs
# `ringattn-bench attention --seqlens 8192,32768 --head-dims 128` from it; the copy's kernel prints
# the per-step cycles of its phases for one CTA. Usage: bench/timeline_backward.sh OUTDIR
#   (writes OUTDIR/timeline_backward.txt; the copy and its build go to $TMPDIR or /tmp)
set -uo pipefail
out="${1:?usage: bench/timeline_backward.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
copy="$(mktemp -d "${TMPDIR:-/tmp}/ringattn-timeline.XXXXXX")"
tar --exclude='./build*' -cf - . | tar -xf - -C "$copy"
python3 bench/timeline_backward.py "$copy/kernels/cuda/flash_backward_sm90.cuh" || exit 1
cmake -S "$copy" -B "$copy/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGATTN_CUDA=ON \
  "-DCMAKE_CUDA_ARCHITECTURES=${RINGATTN_GPU_ARCH:-90a}" > "$out/timeline_backward_build.log" 2>&1 &&
  cmake --build "$copy/build" -j "$(nproc)" --target ringattn-bench >> "$out/timeline_backward_build.log" 2>&1 ||
  { echo "timeline_backward: the instrumented build failed (see timeline_backward_build.log)"; exit 1; }
"$copy/build/ringattn-bench" attention --seqlens 8192,32768 --head-dims 128 > "$out/timeline_backward.txt" 2>&1
status=$?
grep -E "timeline" "$out/timeline_backward.txt"
exit "$status"
