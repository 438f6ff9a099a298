#!/usr/bin/env bash
# Install and start what the integration tests need, as root on a fresh Debian host:
#  - bubblewrap, dockerd and the offline sandbox image          (setup_sandbox.sh)
#  - ssh + iproute2 for the two-host network-namespace tests     (setup_netns_hosts.sh install)
#  - Debian's chromium + chromedriver for the headless UI test   (setup_ui_test.sh)
# The S3 (moto), MLflow and Prefect servers are started by the tests' own fixtures on loopback
# ports and stopped after them. Every script is idempotent and quick when all is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[services] sandbox runtimes"; scripts/setup_sandbox.sh
echo "[services] namespace hosts"; scripts/setup_netns_hosts.sh install
echo "[services] headless browser"; scripts/setup_ui_test.sh
