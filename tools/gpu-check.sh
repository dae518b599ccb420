#!/usr/bin/env bash
# The checks that need the GPU machine: build with CUDA, the gpu and mpi tests, benchmarks.
#
#   tools/gpu-check.sh [--out DIR] [PART...]
#
# PART is one of
#   build        configure build-gpu/ (Ninja, Release, CUDA on, CMAKE_CUDA_ARCHITECTURES from
#                RINGATTN_GPU_ARCH, default 90a) and build it with every core
#   tests        ctest -L 'gpu|mpi' in build-gpu/, JUnit report in DIR/tests-junit.xml;
#                RINGATTN_CTEST_JOBS (default 4) tests at a time (tests that must run alone
#                are RUN_SERIAL); RINGATTN_CTEST_SECONDS=N stops the tests N s after they
#                start (ctest --stop-time: running ones are killed, the rest not run) and the
#                part reports itself incomplete with the count it reached
#   bench-NAME   bench/NAME.sh DIR
#   all          build tests (the default)
# DIR defaults to $OUT, else ./gpu-check-out. Each part logs to DIR/<part>.log; the end prints a
# table of parts, status and seconds and writes it to DIR/summary.json. The exit status is 0 when
# every part passed.
set -uo pipefail
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$self")/.." || exit 2

# NVLink multicast stays off on the reference machines; every launcher below inherits this.
export NCCL_NVLS_ENABLE=0
# The revision the results name, for every part: HEAD, with "-dirty" when tracked files differ
# from it, and the digest of the sources (tools/revision.sh).
export RINGATTN_REVISION="${RINGATTN_REVISION:-$(tools/revision.sh)}"

usage() { sed -n '2,16s/^# \{0,1\}//p' "$self"; }

out="${OUT:-./gpu-check-out}"
parts=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; out="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    all) parts+=(build tests); shift ;;
    build|tests|bench-?*) parts+=("$1"); shift ;;
    *) echo "gpu-check: unknown part '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ ${#parts[@]} -gt 0 ]] || parts=(build tests)
mkdir -p "$out"
out="$(cd "$out" && pwd)"

part_build() {
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGATTN_CUDA=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=${RINGATTN_GPU_ARCH:-90a}" &&
    cmake --build build-gpu -j "$(nproc)"
}

part_tests() {
  local stop=()
  if [[ -n "${RINGATTN_CTEST_SECONDS:-}" ]]; then
    stop=(--stop-time "$(date -d "+${RINGATTN_CTEST_SECONDS} seconds" +%H:%M:%S)")
  fi
  ctest --test-dir build-gpu -L 'gpu|mpi' --no-tests=error --output-on-failure \
    -j "${RINGATTN_CTEST_JOBS:-4}" --output-junit "$out/tests-junit.xml" "${stop[@]}"
}

# "incomplete: ..." when the tests stopped at RINGATTN_CTEST_SECONDS, naming how many of the
# selected tests ran and how many of those failed (a test killed at the stop counts as failed).
tests_stopped_status() {
  grep -q "The stop time has been passed" "$out/tests.log" || return 1
  local total reached failures
  total="$(ctest --test-dir build-gpu -L 'gpu|mpi' -N 2>/dev/null | sed -n 's/^Total Tests: //p')"
  reached="$(grep -m1 -o '\btests="[0-9]*"' "$out/tests-junit.xml" 2>/dev/null | tr -dc 0-9)"
  failures="$(grep -m1 -o 'failures="[0-9]*"' "$out/tests-junit.xml" 2>/dev/null | tr -dc 0-9)"
  echo "incomplete: stopped after ${RINGATTN_CTEST_SECONDS} s, ${reached:-?} of ${total:-?} tests ran, ${failures:-?} failed or were stopped"
}

part_bench() {
  local script="bench/$1.sh"
  if [[ ! -f "$script" ]]; then
    echo "gpu-check: no benchmark $script"
    return 1
  fi
  bash "$script" "$out"
}

names=() statuses=() seconds=()
build_failed=0
for part in "${parts[@]}"; do
  start=$SECONDS
  if [[ $part != build && $build_failed == 1 ]]; then
    status="skipped (build failed)"
  else
    echo "=== gpu-check: $part (log: $out/$part.log)"
    if case "$part" in
         build) part_build ;;
         tests) part_tests ;;
         bench-*) part_bench "${part#bench-}" ;;
       esac 2>&1 | tee "$out/$part.log"; then
      status=passed
      # A skipped gpu test on a GPU machine is worth a look: say how many there were.
      if [[ $part == tests ]]; then
        skipped="$(grep -m1 -o 'skipped="[0-9]*"' "$out/tests-junit.xml" 2>/dev/null | tr -dc 0-9)"
        [[ ${skipped:-0} -gt 0 ]] && status="passed, $skipped skipped"
      fi
    else
      status=failed
      [[ $part == build ]] && build_failed=1
      [[ $part == tests ]] && status="$(tests_stopped_status || echo failed)"
    fi
  fi
  names+=("$part") statuses+=("$status") seconds+=($((SECONDS - start)))
done

gpu_names="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, -)"
revision="$RINGATTN_REVISION"
failed=0
{
  printf '{\n  "date": "%s",\n  "revision": "%s",\n  "gpus": "%s",\n  "parts": [\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$revision" "${gpu_names:-none}"
  for i in "${!names[@]}"; do
    [[ $i -gt 0 ]] && printf ',\n'
    printf '    {"part": "%s", "status": "%s", "seconds": %d}' \
      "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
  done
  printf '\n  ]\n}\n'
} >"$out/summary.json"

echo
printf '%-16s %-24s %8s\n' part status seconds
for i in "${!names[@]}"; do
  printf '%-16s %-24s %8d\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
  [[ "${statuses[$i]}" == passed* ]] || failed=1
done
echo "summary: $out/summary.json"
exit $failed
