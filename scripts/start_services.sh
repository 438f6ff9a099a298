#!/usr/bin/env bash
# Install and start what the integration tests need, as root on a fresh Debian host:
# bubblewrap + dockerd + the offline sandbox image (setup_sandbox.sh), and ssh/iproute2 for the
# two-host namespace test (setup_netns_hosts.sh). The S3 (moto), MLflow and Prefect servers are
# started by the tests' own fixtures on loopback ports and stopped after them.
set -euo pipefail
cd "$(dirname "$0")/.."
for s in scripts/setup_sandbox.sh scripts/setup_netns_hosts.sh; do
  if [ -x "$s" ]; then
    echo "[services] $s"
    "$s"
  fi
done
