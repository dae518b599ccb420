#!/usr/bin/env bash
# Builds ringattn and runs its tests: every label (cpu, mpi, gpu; gpu tests skip without a GPU).
#   tools/test.sh [CTEST ARGS...]      e.g. tools/test.sh -L cpu, tools/test.sh -R dtype -j 2
# The exit status is ctest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh
exec ctest --test-dir build --output-on-failure "$@"
