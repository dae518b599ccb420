#!/usr/bin/env bash
# Runs a command that needs GPUs: require_gpus.sh N COMMAND [ARGS...]
# Exits 77 (ctest: skipped) where fewer than N GPUs are visible, else with the command's status.
set -euo pipefail
needed="$1"
shift
found=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
if [[ "$found" -lt "$needed" ]]; then
  echo "needs $needed GPUs, found $found: skipped"
  exit 77
fi
exec "$@"
