#!/usr/bin/env bash
# Every Debian package `make test` needs, in one apt transaction (as root; idempotent, quick when
# all are present): the sandbox runtimes (bubblewrap, docker.io, debootstrap, python3), the
# namespace hosts of the cluster tests (ssh, iproute2, unshare) and the headless UI test (chromium,
# chromium-driver). One `apt-get update` instead of one per script, and done before the rest of
# set-up runs side by side: apt holds a lock, so two installs at once would fail.
# The scripts it serves (setup_sandbox.sh, setup_netns_hosts.sh, setup_ui_test.sh) still install
# what they miss on their own when run alone.
set -euo pipefail
want=(
  bwrap:bubblewrap debootstrap:debootstrap /usr/bin/python3:python3 dockerd:docker.io
  sshd:openssh-server ssh:openssh-client ip:iproute2 unshare:util-linux
  chromium:chromium chromedriver:chromium-driver
)
missing=()
for pair in "${want[@]}"; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  if [ "${DELTALOOP_NO_DOCKER:-0}" = 1 ] && [ "$pkg" = docker.io ]; then continue; fi
  if [[ $cmd == /* ]]; then [ -x "$cmd" ] || missing+=("$pkg"); continue; fi  # a path: that file, not PATH's
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[packages] all present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[packages] missing ${missing[*]} and not root: the scripts that need them will say so" >&2
  exit 0
fi
echo "[packages] installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
