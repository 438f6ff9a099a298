#!/usr/bin/env bash
# Set up everything `make test` needs, as root on a fresh Debian host (idempotent; quick when all
# is in place):
#  1. every Debian package, in one apt transaction                  (install_packages.sh)
#  2. side by side: the Python environments                         (setup.sh: .venv, .venv-vllm)
#     and dockerd + the offline sandbox image                       (setup_sandbox.sh: debootstrap,
#     docker import; its output goes to $DELTALOOP_STATE/logs/setup_sandbox.log)
#  3. ssh + iproute2 for the two-host network-namespace tests       (setup_netns_hosts.sh install)
#  4. selenium for the headless UI test (needs .venv)               (setup_ui_test.sh)
# Step 2 overlaps downloads and unpacking that wait on the network and the disk, not on each other.
# The S3 (moto), MLflow and Prefect servers are started by the tests' own fixtures on loopback
# ports and stopped after them.
set -euo pipefail
cd "$(dirname "$0")/.."
logs="${DELTALOOP_STATE:-.state}/logs"
mkdir -p "$logs"
echo "[services] system packages"; scripts/install_packages.sh && echo "[packages] ready"
echo "[services] sandbox runtimes, in the background (log: $logs/setup_sandbox.log)"
scripts/setup_sandbox.sh >"$logs/setup_sandbox.log" 2>&1 &
sandbox=$!
scripts/setup.sh
if ! wait "$sandbox"; then
  echo "[services] sandbox set-up failed; the end of $logs/setup_sandbox.log:" >&2
  tail -30 "$logs/setup_sandbox.log" >&2
  exit 1
fi
tail -3 "$logs/setup_sandbox.log"
echo "[services] namespace hosts"; scripts/setup_netns_hosts.sh install
echo "[services] headless browser"; scripts/setup_ui_test.sh
