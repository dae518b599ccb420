#!/usr/bin/env bash
# Runs python/tests/test_ring_mpi.py, test_ring_mpi_masks.py, test_ring_mpi_balanced.py and
# test_ring_mpi_random.py under mpiexec at 1, 2, 3 and 4 ranks (OpenMPI), from any directory:
#
#   python/tests/run_mpi_tests.sh [pytest arguments...]
#
# Every rank runs pytest with its own JUnit report; rank 0 prints its report, the others write
# theirs to a log shown when it differs. A rank count passes when mpiexec exits 0 within the time
# limit, every rank wrote a report, and every rank reached the same verdict on every test with
# none failed. Exits nonzero when any rank count does not pass.
#
# Environment: RINGATTN_TEST_RANKS (default "1 2 3 4"), RINGATTN_TEST_TIMEOUT_S per rank count
# (default 900: a hang becomes a failure), RINGATTN_TEST_SEED (default: a fresh one, printed, the
# same for every rank count), MPIEXEC (default mpiexec). The CPU block runs one thread per rank
# (RINGATTN_NUM_THREADS=1) unless set: the ranks share the machine's cores.
set -u
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
source bench/launch_env.sh
python="${PYTHON:-python3}"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
export RINGATTN_NUM_THREADS="${RINGATTN_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export RINGATTN_TEST_SEED="${RINGATTN_TEST_SEED:-$("$python" -c \
  'import random; print(random.SystemRandom().randrange(2**31))')}"
reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
echo "ring tests: seed $RINGATTN_TEST_SEED (RINGATTN_TEST_SEED=$RINGATTN_TEST_SEED replays it)"

# One rank: pytest with a report of its own; rank 0 on the terminal, the others in a log.
rank_command='
rank="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}"
report="$0/np$1.rank$rank"
shift
if [ "$rank" = 0 ]; then
  exec "$PYTHON_FOR_RANKS" -m pytest -p no:cacheprovider --junitxml="$report.xml" "$@"
fi
exec "$PYTHON_FOR_RANKS" -m pytest -q -p no:cacheprovider --junitxml="$report.xml" "$@" \
  >"$report.log" 2>&1'
export PYTHON_FOR_RANKS="$python"

status=0
summary=()
for n in ${RINGATTN_TEST_RANKS:-1 2 3 4}; do
  echo "=== $n rank(s) ==="
  timeout --kill-after=30 "${RINGATTN_TEST_TIMEOUT_S:-900}" "${MPIEXEC:-mpiexec}" \
    --oversubscribe -n "$n" bash -c "$rank_command" "$reports" "$n" \
    python/tests/test_ring_mpi.py python/tests/test_ring_mpi_masks.py \
    python/tests/test_ring_mpi_balanced.py python/tests/test_ring_mpi_random.py "$@"
  rc=$?
  verdict="$("$python" - "$reports" "$n" "$rc" <<'EOF'
"""Compares the ranks' JUnit reports: the same outcome for every test on every rank."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

folder, n, rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
outcomes, problems = [], []
for rank in range(n):
    path = folder / f"np{n}.rank{rank}.xml"
    if not path.is_file():
        problems.append(f"rank {rank} wrote no report")
        outcomes.append(None)
        continue
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        tests[f"{case.get('classname')}::{case.get('name')}"] = (kinds.pop() if kinds
                                                                 else "passed")
    outcomes.append(tests)
reports = [o for o in outcomes if o is not None]
agreed = not any(o != reports[0] for o in reports[1:]) if reports else False
if reports and not agreed:
    problems.append("the ranks' verdicts differ: "
                    + ", ".join(f"rank {r}: {sorted(set(o.values()))}"
                                for r, o in enumerate(outcomes) if o is not None))
counts = {}
for outcome in (reports[0].values() if reports else []):
    counts[outcome] = counts.get(outcome, 0) + 1
failed = counts.get("failure", 0) + counts.get("error", 0)
if rc != 0 and not failed:
    problems.append(f"mpiexec exited {rc}" + (" (time limit)" if rc in (124, 137) else ""))
text = ", ".join(f"{counts[k]} {k}" for k in ("passed", "skipped", "failure", "error")
                 if k in counts) or "no tests"
ok = not problems and not failed and reports
print(("PASS" if ok else "FAIL") + f" np={n}: {text}"
      + (" on every rank" if agreed and len(reports) == n else " on rank 0")
      + "".join(f"; {p}" for p in problems))
EOF
)"
  echo "$verdict"
  summary+=("$verdict")
  if [[ "$verdict" != PASS* ]]; then
    status=1
    for log in "$reports"/np"$n".rank*.log; do
      [[ -f "$log" ]] && { echo "--- ${log##*/} (last 40 lines)"; tail -n 40 "$log"; }
    done
  fi
done
echo "=== summary (seed $RINGATTN_TEST_SEED) ==="
printf '%s\n' "${summary[@]}"
exit "$status"
