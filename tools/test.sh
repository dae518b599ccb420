#!/usr/bin/env bash
# Installs what the build needs where it is missing (tools/deps.sh: Debian/Ubuntu packages, through
# apt-get), builds ringattn and runs its tests: every label (cpu, mpi, gpu; gpu tests skip without
# a GPU).
#   tools/test.sh [CTEST ARGS...]      e.g. tools/test.sh -L cpu, tools/test.sh -R dtype -j 2
# The exit status is ctest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/deps.sh
tools/build.sh
exec ctest --test-dir build --output-on-failure "$@"
