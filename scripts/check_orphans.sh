#!/usr/bin/env bash
# After the tests: nothing the project or its tests started may still run. Prints what is
# left and exits 1 if anything is. Matches the project's own processes only: every process
# that carries a job id (DTRAIN_JOB_ID) in its environment, and the test daemons by the
# arguments the fixtures start them with (a system sshd or munged is not ours).
set -uo pipefail
pattern='dtrain\.launch|torch\.distributed\.run|moto_server|slurmctld -D|slurmd -D|munged --foreground --force --socket=|sshd -D -e -f /tmp/|airflow (standalone|scheduler|triggerer|api.server|dag-processor|serve-logs)|mpirun |orted '
left=$(ps -eo pid=,args= | grep -E -- "$pattern" | grep -vE "grep|check_orphans" || true)
for environ in /proc/[0-9]*/environ; do
  pid=${environ#/proc/}; pid=${pid%/environ}
  [ "$pid" = $$ ] && continue
  if { tr '\0' '\n' < "$environ"; } 2>/dev/null | grep -q '^DTRAIN_JOB_ID='; then
    left+=$'\n'"$(ps -o pid=,args= -p "$pid" 2>/dev/null)"
  fi
done
left=$(printf '%s\n' "$left" | sed '/^[[:space:]]*$/d' | sort -u)
if [ -n "$left" ]; then
  echo "check_orphans: processes of the project are still running after the tests:"
  printf '%s\n' "$left" | cut -c1-200
  exit 1
fi
echo "check_orphans: no process of the project is left"
