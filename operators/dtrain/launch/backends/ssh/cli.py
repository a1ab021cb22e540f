"""``dtrain launch`` options for the SSH backend, distribution=mpi and distribution=tensorflow.

Kept apart from operators/launch/cli.py, which only calls :func:`add_arguments` and
passes :func:`spec_kwargs` to the LaunchSpec, where every value is validated.
"""

from __future__ import annotations

import argparse
from typing import Any

from operators.launch.hostfile import STRICT_CHOICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    ssh = p.add_argument_group("ssh backend (--backend ssh)")
    ssh.add_argument("--hostfile", metavar="FILE",
                     help="hosts, one per line: '[user@]host[:port] slots=N' (DeepSpeed's 'host slots=N' works); "
                          "the first --nodes hosts run the job, node rank in line order")
    ssh.add_argument("--ssh-user", help="login name (a user@ on a hostfile line wins)")
    ssh.add_argument("--ssh-port", type=int, help="sshd port (a :port on a hostfile line wins)")
    ssh.add_argument("--ssh-key", metavar="FILE", help="private key file (ssh -i)")
    ssh.add_argument("--ssh-known-hosts", metavar="FILE", help="known_hosts file to check host keys against")
    ssh.add_argument("--ssh-strict-host-key-checking", choices=STRICT_CHOICES,
                     help="host-key policy (default accept-new: trust on first use, refuse a changed key)")
    ssh.add_argument("--ssh-connect-timeout", type=int, help="seconds per ssh connection (default 10)")
    ssh.add_argument("--ssh-python", metavar="PATH", help="interpreter on the hosts (default: this one's path)")
    dist = p.add_argument_group("mpi and tensorflow distributions")
    dist.add_argument("--mpi-option", action="append", metavar="OPT", dest="mpi_options",
                      help="extra mpirun option(s), repeatable; write it as --mpi-option='-x NCCL_DEBUG=VERSION'")
    dist.add_argument("--parameter-servers", type=int, default=0,
                      help="distribution tensorflow: ranks that are TF_CONFIG 'ps' tasks (legacy TF 1.x)")


def spec_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    ssh = {
        "user": args.ssh_user, "port": args.ssh_port, "key_file": args.ssh_key,
        "known_hosts_file": args.ssh_known_hosts, "strict_host_key_checking": args.ssh_strict_host_key_checking,
        "connect_timeout": args.ssh_connect_timeout, "python": args.ssh_python,
    }
    ssh = {k: v for k, v in ssh.items() if v is not None}
    return {"hostfile": args.hostfile, "ssh": ssh or None, "mpi_options": args.mpi_options,
            "parameter_servers": args.parameter_servers}
