#!/usr/bin/env bash
# Install the Debian packages that are missing, in one apt transaction (as root; idempotent, quick
# when all are present). The one place set-up installs system packages:
#
#   scripts/install_packages.sh                    everything `make test` needs (below)
#   scripts/install_packages.sh CMD:PKG ...        PKG when the command CMD is missing
#                                                  (CMD may be a path: that file must exist)
#
# Everything: the sandbox runtimes (bubblewrap, docker.io unless DELTALOOP_NO_DOCKER=1, debootstrap,
# python3), the namespace hosts of the cluster tests (ssh, iproute2, unshare) and the headless UI
# test (chromium, chromium-driver). start_services.sh installs them all before the rest of set-up
# runs side by side: one `apt-get update`, and apt holds a lock, so two installs at once would fail.
# Exits 1 when packages are missing and this is not root (naming them).
set -euo pipefail
want=("$@")
if [ ${#want[@]} -eq 0 ]; then
  want=(bwrap:bubblewrap debootstrap:debootstrap /usr/bin/python3:python3 sshd:openssh-server
        ssh:openssh-client ip:iproute2 unshare:util-linux chromium:chromium chromedriver:chromium-driver)
  [ "${DELTALOOP_NO_DOCKER:-0}" = 1 ] || want+=(dockerd:docker.io)
fi
missing=()
for pair in "${want[@]}"; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  if [[ $cmd == /* ]]; then [ -x "$cmd" ] || missing+=("$pkg"); continue; fi  # a path: that file, not PATH's
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "[packages] missing ${missing[*]} and not root: install them first" >&2
  exit 1
fi
echo "[packages] installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
