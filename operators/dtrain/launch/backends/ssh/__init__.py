"""The SSH backend: one torchrun agent per host over OpenSSH (blocking or detached/deferrable).

Everything that knows SSH lives in this folder: hostfile grammar, SSH settings and the options
table (:mod:`.hostfile`), the Airflow connection (:mod:`.connection`), the per-host agents
(:mod:`.remote_agent`, :mod:`.detached_node`), detached jobs (:mod:`.detached`), CLI options
(:mod:`.cli`) and the backend (:mod:`.backend`).
"""

from dtrain.launch.backends.ssh.backend import SSHBackend

__all__ = ["SSHBackend"]
