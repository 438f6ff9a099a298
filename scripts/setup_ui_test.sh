#!/usr/bin/env bash
# What the headless UI test (tests/integration/test_ops_served.py) needs on a fresh Debian host:
# Debian's chromium + its chromedriver (as root, through apt), and selenium in .venv.
# Idempotent and quick when everything is present. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_packages.sh chromium:chromium chromedriver:chromium-driver \
  || echo "[setup-ui] WARNING: without chromium and chromedriver the headless UI test fails" >&2
if ! .venv/bin/python -c "import selenium" >/dev/null 2>&1; then
  echo "[setup-ui] installing selenium into .venv"
  .venv/bin/pip install -q --disable-pip-version-check "selenium>=4.20" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import selenium" && command -v chromium >/dev/null && echo "[setup-ui] ready: $(chromium --version)"
