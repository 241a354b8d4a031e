#!/usr/bin/env bash
# Runs one set-up step quietly: its whole output goes to LOG; the terminal gets one line on
# success, and on failure the log's tail, a one-line diagnosis, and the log's path.
# Usage: scripts/step.sh "what it does" LOG command args...
set -u
what=$1 log=$2
shift 2
mkdir -p "$(dirname "$log")"
printf '%s ... ' "$what"
start=$SECONDS
if "$@" >>"$log" 2>&1; then
  echo "ok ($((SECONDS - start)) s)"
  exit 0
fi
echo "FAILED"
tail -n 25 "$log" | sed 's/^/    /'
if grep -qiE 'NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|Network is unreachable|No matching distribution found|Could not find a version that satisfies|failed to download|Couldn.t resolve host' "$log"; then
  echo "make: no network: pip or cargo could not reach PyPI or crates.io; check the connection (or PIP_INDEX_URL / a proxy) and run make again"
elif grep -qE 'linker .cc. not found|error: linker|could not find native static library|cannot find -l' "$log"; then
  echo "make: the link failed: a C/C++ toolchain or libtorch library is missing (see the log)"
fi
echo "make: '$what' failed; the whole log is $log"
exit 1
