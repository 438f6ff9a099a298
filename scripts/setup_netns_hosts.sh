#!/usr/bin/env bash
# Fake multi-host cluster on this machine: network namespaces with sshd (see tests/integration/netns.py).
#
#   scripts/setup_netns_hosts.sh install          # apt packages the netns tests need (root, Debian/Ubuntu)
#   scripts/setup_netns_hosts.sh up DIR [N]       # N hosts (default 2); prints a cluster: YAML snippet
#   scripts/setup_netns_hosts.sh down DIR         # kill their sshds, delete the namespaces
#
# Needs root (ip netns, mount). The test subnet exists only inside the namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

install() {
  scripts/install_packages.sh sshd:openssh-server ssh:openssh-client ip:iproute2 unshare:util-linux
  mkdir -p /run/sshd
}

case "${1:-}" in
  install) install ;;
  up) install; "$PY" -m tests.integration.netns up --dir "$2" --hosts "${3:-2}" ;;
  down) "$PY" -m tests.integration.netns down --dir "$2" ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
