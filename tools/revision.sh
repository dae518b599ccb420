#!/usr/bin/env bash
# Prints the revision that benchmark results name: git's HEAD (with "-dirty" when tracked files
# differ from it), then a digest of the sources that build and test ringattn (the CMake files,
# include/, src/, kernels/, parallel/, train/, tools/, tests/), e.g. "3f1541f-dirty (sources
# 5d0c3e9a1b2f)". The digest depends on the files alone, so a result stays tied to its code and
# its tests where a checkout's git history lags its files (the device machine gets no .git): the
# same sources give the same digest at any commit, and a test changed after a run shows.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
describe="$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)"
digest="$(find CMakeLists.txt cmake include src kernels parallel train tools tests -type f \
            ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 2>/dev/null |
          LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)"
echo "$describe (sources $digest)"
