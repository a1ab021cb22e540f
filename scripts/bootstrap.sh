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

# Reinstall only when the dependency declaration (or the chosen extras) changed.
stamp=.venv/.dtrain-installed-$( (cat setup.cfg constraints.txt; printf %s "$extras_key") | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  "$VPY" -m pip install -q --upgrade pip setuptools wheel
  "$VPY" -m pip install -q "torch==2.13.0"
  "$VPY" -m pip install -q -c constraints.txt -e ".[$EXTRAS]"
  # The editable build leaves its egg-info in the source root, which the editable install puts on
  # sys.path: Airflow would then read every entry point twice (and report the plugin "already
  # registered"). The installed dist-info in the venv is the metadata that counts.
  rm -rf operators/*.egg-info
  rm -f .venv/.dtrain-installed-*
  touch "$stamp"
fi
