# Sourced by scripts/bootstrap.sh and scripts/compat.sh (needs VPY, the venv's python).
# pip's own settings (pip.conf, PIP_* variables) as uv's options, one per line: where packages come
# from and the constraints every install obeys, so that uv installs exactly what pip would.
# With "no-constraints", the constraint files are left out (an exact pin must not meet a cap there).
uv_options_from_pip() {
  local keep_constraints=yes
  [ "${1:-}" = no-constraints ] && keep_constraints=no
  "$VPY" -m pip config list 2>/dev/null | while IFS= read -r line; do
    key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    case "${key##*.}" in
      index-url) flag=--index-url ;;
      extra-index-url) flag=--extra-index-url ;;
      find-links) flag=--find-links ;;
      constraint) [ $keep_constraints = yes ] || continue; flag=--constraint ;;
      *) continue ;;
    esac
    for item in $value; do printf '%s\n%s\n' "$flag" "$item"; done
  done
}
