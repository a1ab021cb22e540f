#!/usr/bin/env bash
# The compat tier (`bash scripts/test.sh --compat`): the quick tier (-m "not slow") against the oldest
# torch setup.cfg declares (torch>=X) and the newest release on the registry, each in a venv of its own
# (.dtrain/venv-torch-X.Y.Z, made once and kept), so the default suite's venv and time stay as they are.
#
#   bash scripts/test.sh --compat                  # both versions
#   DTRAIN_COMPAT_TORCH="2.9.0" bash scripts/test.sh --compat tests/training -x   # chosen versions; arguments go to pytest
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh  # the main venv: its uv and pip settings make the others
VPY=$ROOT/.venv/bin/python

declared_floor() {
  local floors
  floors=$(sed -n 's/^ *torch>=\([0-9][0-9.]*\) *$/\1/p' setup.cfg | sort -u)
  [ "$(printf '%s\n' "$floors" | wc -l)" = 1 ] || { echo "compat: setup.cfg declares several torch floors: $floors" >&2; exit 2; }
  # pip treats torch>=2.8 as 2.8.0: the floor release
  case "$floors" in *.*.*) echo "$floors" ;; *) echo "$floors.0" ;; esac
}

newest_on_registry() {
  "$VPY" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([0-9][0-9.]*\))$/\1/p'
}

. "$ROOT/scripts/pip_options.sh"  # uv_options_from_pip

make_venv() {  # $1: torch version -> the venv's python on stdout
  local version=$1 venv=$ROOT/.dtrain/venv-torch-$1
  local stamp=$venv/.dtrain-installed-$( (cat setup.cfg constraints.txt) | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ]; then
    mkdir -p "$ROOT/.dtrain"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    local constraints=$venv/constraints.txt options=()
    mapfile -t options < <(uv_options_from_pip no-constraints)  # a pin must not meet the machine's cap
    { grep -v '^torch==' constraints.txt; echo "torch==$version"; } > "$constraints"
    echo "compat: installing torch $version into $venv" >&2
    "$ROOT/.venv/bin/uv" pip install --quiet --python "$venv/bin/python" --index-strategy unsafe-best-match \
      "${options[@]}" -c "$constraints" "torch==$version" -e ".[test]" >&2
    rm -rf operators/*.egg-info  # as bootstrap.sh: the venv's dist-info is the metadata that counts
    rm -f "$venv"/.dtrain-installed-*
    touch "$stamp"
  fi
  echo "$venv/bin/python"
}

versions=${DTRAIN_COMPAT_TORCH:-"$(declared_floor) $(newest_on_registry)"}
failed=()
for version in $versions; do
  python=$(make_venv "$version")
  echo "compat: torch $("$python" -c 'import torch; print(torch.__version__)'): the quick tier" >&2
  start=$SECONDS
  if PATH="$(dirname "$python"):$PATH" "$python" -m pytest -m "not slow" -q -p no:cacheprovider "$@"; then
    echo "compat: torch $version passed in $((SECONDS - start)) s" >&2
  else
    echo "compat: torch $version FAILED in $((SECONDS - start)) s" >&2
    failed+=("$version")
  fi
done
[ ${#failed[@]} = 0 ] || { echo "compat: failed on torch ${failed[*]}" >&2; exit 1; }
