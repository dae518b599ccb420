#!/usr/bin/env bash
# The Python package's tests on a machine without a GPU, as CI runs them (.ci/run): installs what
# is missing through pip (torch, pytest, numpy, mpi4py, transformers; PyPI's torch wheel runs on
# the CPU), then runs python/tests in one process (the CUDA tests report themselves skipped) and the ring tests
# under mpiexec at 2 and 4 ranks (run_mpi_tests.sh). Needs the library built (build/, by
# tools/test.sh). Exits nonzero when a test fails; when pip cannot install the packages it says
# so loudly and exits 0 without running them (CI's network, not the code).
set -u
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
missing=()
for module in torch pytest numpy mpi4py transformers; do
  "$python" -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "python tests: installing ${missing[*]} through pip"
  start=$SECONDS
  if ! "$python" -m pip install --quiet --disable-pip-version-check "${missing[@]}"; then
    echo "python tests NOT RUN: pip could not install ${missing[*]}" >&2
    exit 0
  fi
  echo "python tests: installed in $((SECONDS - start)) s"
fi
status=0
"$python" -m pytest -q -p no:cacheprovider python/tests || status=1
RINGATTN_TEST_RANKS="${RINGATTN_TEST_RANKS:-2 4}" bash python/tests/run_mpi_tests.sh -q --color=no || status=1
exit $status
