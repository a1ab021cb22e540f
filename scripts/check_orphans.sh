#!/usr/bin/env bash
# After the tests: nothing the project or its tests started may still run, and nothing a killed
# job created may be left in shared memory. Prints what is left and exits 1 if anything is.
# Processes: every process that carries a job id (DTRAIN_JOB_ID) in its environment, and the test
# daemons by the arguments the fixtures start them with (a system sshd, munged, PostgreSQL or Redis is
# not ours: tests/deployment.py's run from /tmp/dtrain-pg-* and on the test cluster's 10.231/16 bridge).
# The namespace test cluster (tests/netcluster.py): network namespaces, links (bridge, veths) and
# cgroups whose names start with its prefix, dtn.
# Shared memory (/dev/shm, or CHECK_ORPHANS_SHM_DIR): the names the product's jobs create that no
# running process maps any more (a name still mapped belongs to a run in progress):
#   sem.mp-*                      Python multiprocessing's named semaphores (its queues and locks)
#   deepspeed_allreduce_buffer_*  DeepSpeed's CPU all-reduce buffers (dtrain.launch.node.ds_shm)
#   vader_segment.*               OpenMPI's shared-memory transport (the mpi backend)
#   nccl-*                        NCCL's shared-memory transport (GPU jobs)
set -uo pipefail
pattern='dtrain\.launch|torch\.distributed\.run|moto_server|slurmctld -D|slurmd -D|munged --foreground --force --socket=|sshd -D -e -f /tmp/|airflow (standalone|scheduler|triggerer|api.server|dag-processor|serve-logs|celery)|celeryd: |mpirun |orted |postgres -D /tmp/dtrain-pg-|redis-server 10\.231\.'
left=$(ps -eo pid=,args= | grep -E -- "$pattern" | grep -vE "grep|check_orphans" || true)
for environ in /proc/[0-9]*/environ; do
  pid=${environ#/proc/}; pid=${pid%/environ}
  [ "$pid" = $$ ] && continue
  if { tr '\0' '\n' < "$environ"; } 2>/dev/null | grep -q '^DTRAIN_JOB_ID='; then
    left+=$'\n'"$(ps -o pid=,args= -p "$pid" 2>/dev/null)"
  fi
done
left=$(printf '%s\n' "$left" | sed '/^[[:space:]]*$/d' | sort -u)

shm_dir=${CHECK_ORPHANS_SHM_DIR:-/dev/shm}
shm_names='^(sem\.mp-|deepspeed_allreduce_buffer_|vader_segment\.|nccl-)'
mapped=$(cat /proc/[0-9]*/maps 2>/dev/null | awk -v dir="$shm_dir/" 'index($6, dir) == 1 {print $6}' | sort -u)
shm_left=""
for path in "$shm_dir"/*; do
  [[ ${path##*/} =~ $shm_names ]] || continue
  grep -qxF -- "$path" <<<"$mapped" || shm_left+="$path"$'\n'
done

net_left=$( { ip netns list 2>/dev/null | awk '$1 ~ /^dtn/ {print "netns " $1}'
              ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^dtn/ {sub(/@.*/, "", $2); print "link " $2}'
              for controller in freezer cpu; do
                for dir in /sys/fs/cgroup/$controller/dtn*; do [ -d "$dir" ] && echo "cgroup $controller/${dir##*/}"; done
              done
              for dir in /etc/netns/dtn*; do [ -d "$dir" ] && echo "$dir (a host's resolver file)"; done; } )

# tests/deployment.py's PostgreSQL clusters (their directories: the server removes its own at its stop)
for dir in /tmp/dtrain-pg-*; do [ -d "$dir" ] && net_left+=$'\n'"$dir (a test PostgreSQL cluster's directory)"; done
# each pytest process's home (tests/conftest.py: its Airflow and dtrain homes, removed when it ends)
for dir in /tmp/dtrain-tests-*; do [ -d "$dir" ] && net_left+=$'\n'"$dir (a pytest process's home)"; done
# tests/slurm_cluster.py's Slurm clusters (state, spool, logs, munge key: removed at their stop)
for dir in /tmp/dtrain-slurm-*; do [ -d "$dir" ] && net_left+=$'\n'"$dir (a test Slurm cluster's directory)"; done
net_left=$(printf '%s\n' "$net_left" | sed '/^$/d')

status=0
if [ -n "$left" ]; then
  echo "check_orphans: processes of the project are still running after the tests:"
  printf '%s\n' "$left" | cut -c1-200
  status=1
else
  echo "check_orphans: no process of the project is left"
fi
if [ -n "$net_left" ]; then
  echo "check_orphans: the test clusters (namespace hosts, PostgreSQL, Slurm) left these behind:"
  printf '%s\n' "$net_left"
  status=1
else
  echo "check_orphans: no network namespace, link, cgroup, resolver file or cluster directory of the test clusters is left"
fi
if [ -n "$shm_left" ]; then
  echo "check_orphans: shared memory of the project is left in $shm_dir (no process maps it):"
  printf '%s' "$shm_left"
  status=1
else
  echo "check_orphans: no shared memory of the project is left in $shm_dir"
fi
exit $status
