#!/usr/bin/env bash
# Idempotent setup: a venv in .venv with torch (CPU wheel, installed first so no
# CUDA build is pulled), the package with its extras, and the Debian packages
# the test services need. A second run skips everything already done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

# Extras to install: `test` unless DTRAIN_EXTRAS says otherwise (opt-in, e.g. DTRAIN_EXTRAS=bench in a clone of its own for
# bench/data_formats.py's peers; scripts/test.sh and CI never set it).
EXTRAS=${DTRAIN_EXTRAS:-test}
case "$EXTRAS" in
  *[!A-Za-z0-9,_-]*) echo "bootstrap: DTRAIN_EXTRAS='$EXTRAS' is invalid: comma-separated extra names of setup.cfg" >&2; exit 2 ;;
esac
extras_key=""; [ "$EXTRAS" = test ] || extras_key="$EXTRAS"

# Debian packages the tests' real services need (installed only when missing).
APT_PACKAGES=${DTRAIN_APT_PACKAGES:-"$(cat scripts/apt-packages.txt 2>/dev/null | grep -v '^#' | xargs)"}
missing=()
for pkg in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=$ROOT/.venv/bin/python

. "$ROOT/scripts/pip_options.sh"  # uv_options_from_pip

# Install into the venv with uv (pip's resolution, every index's best match; it asks the registry
# in parallel: 42 s here where pip takes 234 s, one package at a time), with pip when uv cannot be had.
# Both byte-compile what they install: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) Python
# never writes a .pyc, so without them every rank, launcher and Airflow process would compile torch,
# Airflow and DeepSpeed from source (import torch: 3.7 s instead of 2.4; import deepspeed: 10 s instead of 6).
install() {
  if [ -n "$UV" ] && "$UV" pip install --quiet --compile-bytecode --python "$VPY" \
      --index-strategy unsafe-best-match "${uv_options[@]}" "$@"; then
    return
  fi
  "$VPY" -m pip install -q "$@"
}

# Reinstall only when the dependency declaration (or the chosen extras) changed.
stamp=.venv/.dtrain-installed-$( (cat setup.cfg constraints.txt; printf %s "$extras_key") | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  UV=""
  "$VPY" -m pip install -q --no-compile uv >/dev/null 2>&1 && UV=$ROOT/.venv/bin/uv
  mapfile -t uv_options < <(uv_options_from_pip)
  pip_cert=$("$VPY" -m pip config get global.cert 2>/dev/null || true)
  [ -n "${SSL_CERT_FILE:-}" ] || [ -z "$pip_cert" ] || export SSL_CERT_FILE=$pip_cert
  install --upgrade pip setuptools wheel
  install "torch==2.13.0"  # alone first: the CPU wheel, so no CUDA build is pulled
  install -c constraints.txt -e ".[$EXTRAS]"
  # The editable build leaves its egg-info in the source root, which the editable install puts on
  # sys.path: Airflow would then read every entry point twice (and report the plugin "already
  # registered"). The installed dist-info in the venv is the metadata that counts.
  rm -rf operators/*.egg-info
  rm -f .venv/.dtrain-installed-*
  touch "$stamp"
fi
# The package itself is installed editable: its modules run in every launcher and rank process too, so
# they are compiled on every run (only what changed since the last one: a fraction of a second).
"$VPY" -m compileall -q -j 0 operators >/dev/null || true
