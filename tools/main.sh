#!/usr/bin/env bash
# Builds ringattn and runs the main job, build/ringattn-demo (arguments are passed on to it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh --quiet
exec build/ringattn-demo "$@"
