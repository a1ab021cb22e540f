"""``dtrain launch`` options of the SSH backend (``--hostfile``, ``--ssh-*``).

The generic launch CLI asks every registered backend for its options; these become the
spec's ``backend_options`` (validated there) when ``--backend ssh`` is chosen.
"""

from __future__ import annotations

import argparse
from typing import Any

from dtrain.launch.backends.ssh.hostfile import STRICT_CHOICES


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
    ssh.add_argument("--ssh-fanout", type=int, metavar="N",
                     help="at most N ssh clients at once for start, status, stop and preflight (default 32, like pdsh -f)")
    ssh.add_argument("--ssh-poll-interval", type=float, metavar="S",
                     help="seconds before the first poll of a detached job (default 2)")
    ssh.add_argument("--ssh-max-poll-interval", type=float, metavar="S",
                     help="the poll interval grows by half each poll up to this (default 30)")
    ssh.add_argument("--ssh-lost-after", type=float, metavar="S",
                     help="a host silent this long is lost, and a node cut off from the launcher this long "
                          "fences itself (default 30, more than 10)")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "hostfile": args.hostfile, "user": args.ssh_user, "port": args.ssh_port, "key_file": args.ssh_key,
        "known_hosts_file": args.ssh_known_hosts, "strict_host_key_checking": args.ssh_strict_host_key_checking,
        "connect_timeout": args.ssh_connect_timeout, "python": args.ssh_python, "fanout": args.ssh_fanout,
        "poll_interval": args.ssh_poll_interval, "max_poll_interval": args.ssh_max_poll_interval,
        "lost_after": args.ssh_lost_after,
    }
    return {k: v for k, v in options.items() if v is not None}
