#!/usr/bin/env bash
# Runs a gpu test binary under compute-sanitizer: sanitize.sh SANITIZER TOOL BINARY [ARGS...]
# Exits 77 (ctest: skipped) where no GPU is visible, else with the sanitizer's verdict: any
# error it reports fails the test.
set -euo pipefail
sanitizer="$1" tool="$2"
shift 2
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU visible: compute-sanitizer --tool $tool skipped"
  exit 77
fi
exec "$sanitizer" --tool "$tool" --error-exitcode 1 "$@"
