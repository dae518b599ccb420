#!/usr/bin/env bash
# Configures (once) and builds ringattn in build/, Release, with every core.
#   tools/build.sh [--quiet]     --quiet: output to build/build.log, shown only when a step fails
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quiet=0
if [[ "${1:-}" == "--quiet" ]]; then quiet=1; fi

steps() {
  if [[ ! -f build/CMakeCache.txt ]]; then
    generator=()
    if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
    cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
  else
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
  fi
  cmake --build build -j "$(nproc)"
}

if [[ $quiet == 1 ]]; then
  mkdir -p build
  echo "building ringattn in build/ (log: build/build.log)" >&2
  if ! steps >build/build.log 2>&1; then
    tail -n 60 build/build.log >&2
    echo "build failed; the whole log is build/build.log" >&2
    exit 1
  fi
else
  steps
fi
