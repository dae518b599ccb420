#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages that building and testing ringattn need, those missing only
# (a package of a program already on PATH, such as cmake or ninja, is not missing);
# tools/main.sh and tools/test.sh (and so .ci/run) run it before building. When nothing is missing
# it prints nothing and uses no network. Missing packages are installed with apt-get, as root or
# through sudo without a password; where neither works it stops (status 1) with the command to
# run. On a system without dpkg-query and apt-get it only checks that cmake, a C++ compiler and
# mpiexec exist (CMake names any missing library), and stops with what to install if one does not.
#   tools/deps.sh
# For tests (tests/tools/deps_dry_run.sh), nothing is installed with RINGATTN_DEPS_DRY_RUN=1:
#   RINGATTN_DEPS_DRY_RUN=1                print the apt-get commands instead of running them
#   RINGATTN_DEPS_PACKAGES="a b"           the packages needed, instead of the list below
#   RINGATTN_DEPS_INSTALLED="a b"          the packages installed, instead of dpkg-query's answer
#   RINGATTN_DEPS_PRIVILEGE=root|sudo|none how apt-get may run, instead of id -u and sudo -n true
#                                          (none: the path that prints the command to run)
set -euo pipefail

packages=(cmake ninja-build g++ libopenmpi-dev openmpi-bin libhdf5-dev libyaml-cpp-dev
          libcli11-dev libgtest-dev libgmock-dev)
if [[ -n ${RINGATTN_DEPS_PACKAGES+set} ]]; then read -ra packages <<<"$RINGATTN_DEPS_PACKAGES"; fi
dry_run=${RINGATTN_DEPS_DRY_RUN:-0}
have() { command -v "$1" >/dev/null 2>&1; }

# Not Debian/Ubuntu: dpkg-query or apt-get is absent (where the hooks do not stand in for them).
if { [[ -z ${RINGATTN_DEPS_INSTALLED+set} ]] && ! have dpkg-query; } ||
   { [[ $dry_run != 1 ]] && ! have apt-get; }; then
  absent=()
  for tool in cmake c++ mpiexec; do
    if ! have "$tool"; then absent+=("$tool"); fi
  done
  if [[ ${#absent[@]} -eq 0 ]]; then exit 0; fi
  echo "ringattn's build needs CMake >= 3.25, a C++20 compiler, OpenMPI, HDF5 (C API), yaml-cpp," \
       "CLI11 and GoogleTest/GMock; not found here: ${absent[*]}." >&2
  echo "This system has no dpkg-query/apt-get: install them with its package manager," \
       "then run this command again." >&2
  exit 1
fi

if [[ -n ${RINGATTN_DEPS_INSTALLED+set} ]]; then
  installed=$RINGATTN_DEPS_INSTALLED
else
  # dpkg-query fails when it knows none of some package: that one is missing, not an error.
  installed=$(dpkg-query -W -f='${db:Status-Status} ${Package}\n' "${packages[@]}" 2>/dev/null |
              sed -n 's/^installed //p' || true)
fi
# A package whose program is on PATH counts as present, however it came there (a pip cmake or
# ninja in a virtual environment, a compiler or an MPI of a module system).
declare -A program_of=([cmake]=cmake [ninja-build]=ninja [g++]=g++ [openmpi-bin]=mpiexec)
missing=()
for package in "${packages[@]}"; do
  if [[ " ${installed//[[:space:]]/ } " == *" $package "* ]]; then continue; fi
  if [[ -n ${program_of[$package]:-} ]] && have "${program_of[$package]}"; then continue; fi
  missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then exit 0; fi

privilege=${RINGATTN_DEPS_PRIVILEGE:-}
if [[ -z $privilege ]]; then
  if [[ $(id -u) -eq 0 ]]; then
    privilege=root
  elif have sudo && sudo -n true 2>/dev/null; then
    privilege=sudo
  else
    privilege=none
  fi
elif [[ ! $privilege =~ ^(root|sudo|none)$ ]]; then
  echo "RINGATTN_DEPS_PRIVILEGE is '$privilege'; expected root, sudo or none" >&2
  exit 1
fi
if [[ $privilege == none ]]; then
  echo "ringattn's build needs these packages, not installed: ${missing[*]}." >&2
  echo "Installing them needs root; run" >&2
  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  echo "then run this command again." >&2
  exit 1
fi

sudo=()
if [[ $privilege == sudo ]]; then sudo=(sudo); fi
# env, not an assignment before the command: sudo would drop DEBIAN_FRONTEND from the environment.
update=("${sudo[@]}" apt-get update -qq)
install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive
         apt-get install -y -qq --no-install-recommends "${missing[@]}")
if [[ $dry_run == 1 ]]; then
  echo "${update[*]}"
  echo "${install[*]}"
  exit 0
fi
echo "installing what ringattn's build needs: ${missing[*]} (apt-get)" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quietly() {
  if ! "$@" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "failed: $*" >&2
    exit 1
  fi
}
quietly "${update[@]}"
quietly "${install[@]}"
