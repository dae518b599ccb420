#!/usr/bin/env bash
# Checks tools/deps.sh in its dry run (nothing is installed) on package lists whose missing ones are
# known by construction: what it prints, on which stream, and its exit status.
#   tests/tools/deps_dry_run.sh CASE DEPS_SH
#   CASE: one_missing, none_missing, on_path, no_sudo, other_system, dpkg_query
# Exit status 0 when the case holds, 1 (with what was expected and what came) when not, 77 to skip.
set -uo pipefail
case_name=$1
deps_sh=$2
unset RINGATTN_DEPS_PACKAGES RINGATTN_DEPS_INSTALLED RINGATTN_DEPS_PRIVILEGE
export RINGATTN_DEPS_DRY_RUN=1
err_file=$(mktemp)
trap 'rm -f "$err_file"' EXIT

# deps VAR=VALUE...: runs deps.sh with those variables; sets status, out (stdout) and err (stderr).
deps() {
  out=$(env "$@" "$BASH" "$deps_sh" 2>"$err_file")
  status=$?
  err=$(<"$err_file")
}
fail() {
  printf '%s: %s\n--- status %s, stdout:\n%s\n--- stderr:\n%s\n' \
    "$case_name" "$1" "$status" "$out" "$err" >&2
  exit 1
}
install_line="apt-get install -y -qq --no-install-recommends"

case $case_name in
  one_missing)
    # libhdf5-dev-doc is installed, libhdf5-dev is not: a name is matched whole.
    packages="cmake libhdf5-dev g++"
    installed="g++ libhdf5-dev-doc cmake"
    for privilege in root sudo; do
      prefix=
      if [[ $privilege == sudo ]]; then prefix="sudo "; fi
      want="${prefix}apt-get update -qq"$'\n'"${prefix}env DEBIAN_FRONTEND=noninteractive $install_line libhdf5-dev"
      deps RINGATTN_DEPS_PACKAGES="$packages" RINGATTN_DEPS_INSTALLED="$installed" \
           RINGATTN_DEPS_PRIVILEGE=$privilege
      [[ $status == 0 && $out == "$want" && -z $err ]] ||
        fail "as $privilege: expected status 0, nothing on stderr and on stdout exactly:"$'\n'"$want"
    done
    ;;
  none_missing)
    # Every one installed, with others, in another order, one a line.
    deps RINGATTN_DEPS_PACKAGES="cmake libhdf5-dev g++" \
         RINGATTN_DEPS_INSTALLED=$'g++\nlibhdf5-dev-doc\nlibhdf5-dev\ncmake' RINGATTN_DEPS_PRIVILEGE=root
    [[ $status == 0 && -z $out && -z $err ]] || fail "expected status 0 and no output"
    ;;
  on_path)
    # cmake and ninja-build not installed as packages, but cmake is on PATH (as a pip cmake is):
    # only ninja-build is missing.
    bin_dir=$(mktemp -d)
    trap 'rm -f "$err_file"; rm -rf "$bin_dir"' EXIT
    printf '#!/bin/sh\nexit 0\n' >"$bin_dir/cmake"
    chmod +x "$bin_dir/cmake"
    deps PATH="$bin_dir" RINGATTN_DEPS_PACKAGES="cmake ninja-build libhdf5-dev" \
         RINGATTN_DEPS_INSTALLED="libhdf5-dev" RINGATTN_DEPS_PRIVILEGE=root
    want="apt-get update -qq"$'\n'"env DEBIAN_FRONTEND=noninteractive $install_line ninja-build"
    [[ $status == 0 && $out == "$want" && -z $err ]] ||
      fail "expected status 0, nothing on stderr and on stdout exactly:"$'\n'"$want"
    ;;
  no_sudo)
    deps RINGATTN_DEPS_PACKAGES="cmake libhdf5-dev libgtest-dev" RINGATTN_DEPS_INSTALLED="cmake" \
         RINGATTN_DEPS_PRIVILEGE=none
    want="sudo apt-get update && sudo apt-get install -y --no-install-recommends libhdf5-dev libgtest-dev"
    [[ $status != 0 && -z $out && $err == *"$want"* ]] ||
      fail "expected a non-zero status, nothing on stdout and on stderr the command:"$'\n'"$want"
    ;;
  other_system)
    # No dpkg-query, apt-get, cmake, c++ or mpiexec on PATH: another distribution, nothing found.
    deps PATH=/nonexistent
    want="CMake >= 3.25, a C++20 compiler, OpenMPI, HDF5 (C API), yaml-cpp, CLI11 and GoogleTest/GMock; not found here: cmake c++ mpiexec."
    [[ $status != 0 && -z $out && $err == *"$want"* ]] ||
      fail "expected a non-zero status, nothing on stdout and on stderr:"$'\n'"$want"
    ;;
  dpkg_query)
    # dpkg-query itself: the package dpkg is installed wherever dpkg-query is, the other exists nowhere.
    command -v dpkg-query >/dev/null 2>&1 || exit 77
    deps RINGATTN_DEPS_PACKAGES="dpkg ringattn-no-such-package" RINGATTN_DEPS_PRIVILEGE=root
    want="apt-get update -qq"$'\n'"env DEBIAN_FRONTEND=noninteractive $install_line ringattn-no-such-package"
    [[ $status == 0 && $out == "$want" && -z $err ]] ||
      fail "expected status 0, nothing on stderr and on stdout exactly:"$'\n'"$want"
    ;;
  *)
    echo "unknown case '$case_name'" >&2
    exit 1
    ;;
esac
