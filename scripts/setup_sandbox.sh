#!/usr/bin/env bash
# Prepare this host for deltaloop's sandboxes (idempotent; run as root, e.g. by .ci/run):
#   1. install bubblewrap, docker.io, debootstrap and python3 when missing (apt);
#   2. start dockerd when `docker info` does not answer, and wait until it does;
#   3. build the image deltaloop-sandbox:latest OFFLINE when it is missing: debootstrap a minimal
#      Debian rootfs with python3 (cached under /var/cache/deltaloop), then `docker import` it.
#      The same rootfs folder can serve bubblewrap (sandbox.rootfs: /var/cache/deltaloop/rootfs).
# Hosts that can reach a registry may instead build infra/sandbox/image/Dockerfile.
#
# Environment: DELTALOOP_SANDBOX_IMAGE (deltaloop-sandbox:latest), DELTALOOP_CACHE (/var/cache/deltaloop),
# DELTALOOP_DEBIAN_MIRROR (http://deb.debian.org/debian), DELTALOOP_DEBIAN_SUITE (this host's codename),
# DELTALOOP_NO_DOCKER=1 to skip steps 2-3.
set -euo pipefail

IMAGE="${DELTALOOP_SANDBOX_IMAGE:-deltaloop-sandbox:latest}"
CACHE="${DELTALOOP_CACHE:-/var/cache/deltaloop}"
MIRROR="${DELTALOOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE="${DELTALOOP_DEBIAN_SUITE:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-bookworm}")}"
SUITE="${SUITE:-bookworm}"
ROOTFS="$CACHE/rootfs"
TARBALL="$CACHE/rootfs-$SUITE.tar"
log() { echo "[setup_sandbox] $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  log "not root: skipping package installs and dockerd start"
  SUDO_OK=0
else
  SUDO_OK=1
fi

# ---------------------------------------------------------------------------------- 1. packages
pkgs=(bwrap:bubblewrap debootstrap:debootstrap /usr/bin/python3:python3)
[ "${DELTALOOP_NO_DOCKER:-0}" = 1 ] || pkgs+=(dockerd:docker.io)
"$(dirname "$0")/install_packages.sh" "${pkgs[@]}"
[ "${DELTALOOP_NO_DOCKER:-0}" = 1 ] && { log "DELTALOOP_NO_DOCKER=1: done (bwrap only)"; exit 0; }

# ---------------------------------------------------------------------------------- 2. dockerd
if ! docker info >/dev/null 2>&1; then
  [ "$SUDO_OK" = 1 ] || { log "docker daemon not reachable and not root"; exit 1; }
  mkdir -p /var/log
  start_dockerd() {
    log "starting dockerd $*"
    nohup dockerd --host unix:///var/run/docker.sock "$@" >/var/log/deltaloop-dockerd.log 2>&1 &
    for _ in $(seq 1 60); do
      docker info >/dev/null 2>&1 && return 0
      kill -0 $! 2>/dev/null || return 1
      sleep 1
    done
    return 1
  }
  start_dockerd || start_dockerd --iptables=false --bridge=none || \
    start_dockerd --iptables=false --bridge=none --storage-driver=vfs || {
      log "dockerd did not start; see /var/log/deltaloop-dockerd.log"; tail -20 /var/log/deltaloop-dockerd.log >&2; exit 1; }
fi
log "docker daemon is up ($(docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null))"

# ------------------------------------------------------------------------------------- 3. image
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE present"
  exit 0
fi
mkdir -p "$CACHE"
if [ ! -f "$ROOTFS/.deltaloop-complete" ]; then
  if [ -f "$TARBALL" ]; then
    log "unpacking cached rootfs $TARBALL"
    rm -rf "$ROOTFS.tmp"; mkdir -p "$ROOTFS.tmp"
    tar -C "$ROOTFS.tmp" -xf "$TARBALL"
  else
    log "debootstrap $SUITE (minbase + python3) from $MIRROR (about a minute)"
    rm -rf "$ROOTFS.tmp"
    debootstrap --variant=minbase --include=python3 "$SUITE" "$ROOTFS.tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || {
      tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    # Trim what a scoring sandbox never needs; add the scratch mount point.
    rm -rf "$ROOTFS.tmp"/usr/share/{doc,man,info,locale,lintian} "$ROOTFS.tmp"/var/cache/apt/* \
           "$ROOTFS.tmp"/var/lib/apt/lists/* "$ROOTFS.tmp"/var/log/*
    mkdir -p "$ROOTFS.tmp/scratch"; chmod 1777 "$ROOTFS.tmp/scratch"
    tar -C "$ROOTFS.tmp" --numeric-owner -cf "$TARBALL.part" . && mv "$TARBALL.part" "$TARBALL"
  fi
  touch "$ROOTFS.tmp/.deltaloop-complete"
  rm -rf "$ROOTFS"; mv "$ROOTFS.tmp" "$ROOTFS"
fi
log "importing $IMAGE from $TARBALL"
docker import \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /' \
  --change 'USER 65534:65534' \
  --change "LABEL org.deltaloop.sandbox.rootfs=$(sha256sum "$TARBALL" | cut -c1-16)" \
  --change 'CMD ["python3"]' \
  "$TARBALL" "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -c 'import json, ctypes, socket, resource; print("sandbox image ok")'
