"""Hostfiles (DeepSpeed's ``host slots=N`` format, plus an SSH user and port), SSH settings, and the
backend's options table (:data:`SSH_OPTIONS`: its flags, checks and docs come from there).

Stdlib only and pure: the launch spec validates with it before anything starts.

Hostfile syntax, one host per line (``#`` starts a comment, blank lines are skipped)::

    worker-1 slots=4                 # DeepSpeed's format, unchanged
    alice@worker-2 slots=4           # log in as alice
    worker-3:2222 slots=4            # sshd on port 2222
    alice@[fd00::3]:2222 slots=4     # IPv6 addresses go in brackets
    worker-4                         # slots omitted: not checked against procs_per_node

The node rank is the line order: the first host is node 0 and hosts the
rendezvous (MASTER_ADDR). A user or port on a line wins over the SSH settings'
defaults. Every error names the source, the line number and the offending value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from dtrain import grammar
from dtrain.args import coerce_float, mapping_arg, read_input_file
from dtrain.errors import SpecError
from dtrain.launch.backends.ssh.fanout import DEFAULT_FANOUT, MAX_FANOUT
from dtrain.launch.core.lost import DEFAULT_LOST_AFTER_S, MIN_LOST_AFTER_S
from dtrain.options import Option, Options, integer

TARGET_RE = grammar.HOST_TARGET  # the one copy: autotune's hosts follow it too
USER_RE = grammar.HOST_USER
TARGET_SYNTAX = "[user@]host[:port] [slots=N], e.g. 'alice@worker-1:2222 slots=4'"
STRICT_CHOICES = ("yes", "accept-new", "no")


@dataclass(frozen=True)
class HostEntry:
    """One host of a hostfile. ``user``/``port`` None: the SSH settings' (or ssh's) default."""

    host: str
    slots: int | None = None
    user: str | None = None
    port: int | None = None
    line: int = 0

    @property
    def address(self) -> str:
        """The address other nodes use to reach this host (brackets of an IPv6 literal removed)."""
        return self.host[1:-1] if self.host.startswith("[") else self.host

    @property
    def label(self) -> str:
        """``[user@]host[:port]``: tells apart hosts on one address (error messages)."""
        return (f"{self.user}@" if self.user else "") + self.host + (f":{self.port}" if self.port else "")

    def __str__(self) -> str:
        return self.label + (f" slots={self.slots}" if self.slots is not None else "")


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[HostEntry]:
    """Parse hostfile lines; raise :class:`SpecError` naming ``source`` and the line on bad input."""
    entries: list[HostEntry] = []
    seen: dict[tuple, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = _parse_line(line, number, source)
        key = (entry.user, entry.address, entry.port)
        if key in seen:
            raise SpecError(f"{source} line {number}", line, f"each host once (already on line {seen[key]})")
        seen[key] = number
        entries.append(entry)
    if not entries:
        raise SpecError(source, text if len(text) < 200 else text[:200] + "...", "at least one host line: " + TARGET_SYNTAX)
    return entries


def _parse_line(line: str, number: int, source: str) -> HostEntry:
    field = f"{source} line {number}"
    target, *options = line.split()
    match = TARGET_RE.match(target)
    if match is None:
        raise SpecError(field, target, TARGET_SYNTAX + " (IPv6 in brackets)")
    port = None
    if match.group("port") is not None:
        port = int(match.group("port"))
        if not 1 <= port <= 65535:
            raise SpecError(field, match.group("port"), "a port between 1 and 65535")
    slots = None
    for option in options:
        key, sep, value = option.partition("=")
        if key != "slots" or not sep:
            raise SpecError(field, option, "only 'slots=N' may follow the host")
        if slots is not None:
            raise SpecError(field, option, "slots given once")
        if not value.isdigit() or int(value) < 1:
            raise SpecError(field, value, "slots must be a positive integer")
        slots = int(value)
    return HostEntry(host=match.group("host"), slots=slots, user=match.group("user"), port=port, line=number)


def read_hostfile(path: str) -> list[HostEntry]:
    return parse_hostfile_text(read_input_file("hostfile", path), source=f"hostfile {path}")


def coerce_hosts(value: Any) -> list[HostEntry]:
    """``hosts`` as given to the spec: hostfile lines as a list, or one string of lines / commas."""
    if isinstance(value, str):
        lines = [part for chunk in value.splitlines() for part in chunk.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise SpecError("hosts", value, "a list of hostfile lines, e.g. ['worker-1 slots=4', 'worker-2 slots=4']")
    return parse_hostfile_text("\n".join(line.strip() for line in lines), source="hosts")


#: seconds between ssh's keepalives (ServerAliveInterval) and between the launcher's lease renewals
KEEPALIVE_S = 5


def _seconds(minimum: float):
    """Seconds in (minimum, 3600]."""
    return lambda name, value: coerce_float(name, value, minimum=minimum, maximum=3600.0)


def _user(name: str, value: Any) -> Any:
    if not USER_RE.match(str(value)):
        raise SpecError(name, value, "a login name of letters, digits, '.', '_' or '-'")
    return value


def _python(name: str, value: Any) -> Any:
    if not str(value).startswith("/") or "\0" in str(value):
        raise SpecError(name, value, "an absolute path to the interpreter on the hosts")
    return value


#: the ssh backend's options (its ``backend_options``), declared once: its ``dtrain launch`` flags, the
#: checks of :class:`SSHSettings` and the ssh table of docs/backends.md come from here
SSH_OPTIONS = Options([
    Option("hostfile", str, None, "hosts, one per line: '[user@]host[:port] slots=N' (DeepSpeed's 'host slots=N' "
                                  "works); the first --nodes hosts run the job, node rank in line order",
           cli={"metavar": "FILE"}),
    Option("hosts", list[str], None, "the hostfile's lines themselves (instead of hostfile)", flag=None),
    Option("user", str, None, "login name (a user@ on a hostfile line wins)", check=_user, flag="--ssh-user"),
    Option("port", int, None, "sshd port (a :port on a hostfile line wins)", check=integer(1, 65535),
           flag="--ssh-port"),
    Option("key_file", str, None, "private key file (ssh -i)", flag="--ssh-key", cli={"metavar": "FILE"}),
    Option("known_hosts_file", str, None, "known_hosts file to check host keys against", flag="--ssh-known-hosts",
           cli={"metavar": "FILE"}),
    Option("strict_host_key_checking", str, "accept-new", "host-key policy (default accept-new: trust on first use, "
                                                          "refuse a changed key)", choices=STRICT_CHOICES,
           flag="--ssh-strict-host-key-checking"),
    Option("connect_timeout", int, 10, "seconds per ssh connection (default 10)", check=integer(1, 600),
           flag="--ssh-connect-timeout"),
    Option("python", str, None, "interpreter on the hosts (default: this one's path)", check=_python,
           flag="--ssh-python", cli={"metavar": "PATH"}),
    Option("fanout", int, DEFAULT_FANOUT, "at most N ssh clients at once for start, status, stop and preflight "
                                          "(default 32, like pdsh -f)", check=integer(1, MAX_FANOUT),
           flag="--ssh-fanout", cli={"metavar": "N"}),
    Option("poll_interval", float, 2.0, "seconds before the first poll of a detached job (default 2)",
           check=_seconds(0.0), flag="--ssh-poll-interval", cli={"metavar": "S"}),
    Option("max_poll_interval", float, 30.0, "the poll interval grows by half each poll up to this (default 30)",
           check=_seconds(0.0), flag="--ssh-max-poll-interval", cli={"metavar": "S"}),
    Option("lost_after", float, DEFAULT_LOST_AFTER_S, "a host silent this long is lost, and a node cut off from the "
                                                      "launcher this long fences itself (default 30, more than 10)",
           check=_seconds(MIN_LOST_AFTER_S), flag="--ssh-lost-after", cli={"metavar": "S"}),
    Option("conn_id", str, None, "operators only: an Airflow SSH connection giving the hosts and settings",
           flag=None),
], title="ssh backend (--backend ssh)", prefix="ssh.")
HOST_OPTIONS = ("hostfile", "hosts")
#: the options that are :class:`SSHSettings`' fields
SETTINGS_TABLE = SSH_OPTIONS.subset([name for name in SSH_OPTIONS.names if name not in (*HOST_OPTIONS, "conn_id")])


@dataclass(frozen=True)
@SETTINGS_TABLE.fields()
class SSHSettings:
    """How to reach the hosts. Per-host ``user@``/``:port`` in the hostfile win over ``user``/``port``.

    Args:
        user: login name (default: ssh's, i.e. the current user or ~/.ssh/config).
        port: sshd port (default 22 or ~/.ssh/config).
        key_file: private key (``-i``, with IdentitiesOnly); the key never appears in argv, only its path.
        known_hosts_file: known_hosts to check host keys against (default ssh's).
        strict_host_key_checking: ``yes``, ``accept-new`` (default: trust a host on first use,
            refuse a changed key) or ``no``.
        connect_timeout: seconds for each ssh connection.
        python: the interpreter on the hosts (default: this one's path, as on a cluster
            with the same image or a shared installation).
        fanout: at most this many ssh clients at once for every action on the hosts (start,
            status, stop, signals, preflight), like pdsh's ``-f`` (default 32): sshd's MaxStartups
            refuses simultaneous handshakes beyond its limit (10 by default) at random.
        poll_interval: seconds between the first polls of a deferred job (default 2).
        max_poll_interval: the poll interval grows by half each poll up to this (default 30):
            a long job costs the triggerer a few reads a minute.
        lost_after: seconds without an answer from a host before it counts as lost (default 30):
            ssh's keepalive asks every :data:`KEEPALIVE_S` seconds and gives up after this long, and
            each node of a running job fences itself (stops its ranks) when it has not heard from the
            launcher for this long (see dtrain.launch.backends.ssh.remote_agent).
    """

    # its fields: one keyword-only field per option of SETTINGS_TABLE (SETTINGS_TABLE.fields)
    FIELDS: ClassVar[tuple[str, ...]] = SETTINGS_TABLE.names

    @property
    def keepalive_count(self) -> int:
        """ssh's ServerAliveCountMax: unanswered keepalives, :data:`KEEPALIVE_S` apart, that end a connection."""
        return max(1, math.ceil(self.lost_after / KEEPALIVE_S))

    @classmethod
    def from_mapping(cls, value: Any) -> "SSHSettings":
        if isinstance(value, SSHSettings):
            return value
        value = mapping_arg("ssh", value, not_json="a mapping (or JSON object) of SSH settings",
                            not_mapping=f"a mapping with keys among {', '.join(cls.FIELDS)}")
        unknown = sorted(set(value) - set(cls.FIELDS))
        if unknown:
            raise SpecError("ssh", unknown[0], f"one of {', '.join(cls.FIELDS)}")
        return cls._validated({k: v for k, v in value.items() if v is not None and v != ""})

    @classmethod
    def _validated(cls, v: dict[str, Any]) -> "SSHSettings":
        def option(name: str, default: Any = None) -> Any:  # checked as SSH_OPTIONS declares it
            return SETTINGS_TABLE.check(name, v.get(name, SETTINGS_TABLE[name].default if default is None else default))

        user, port = option("user"), option("port")
        key_file = v.get("key_file")
        if key_file is not None and not os.path.isfile(os.path.expanduser(str(key_file))):
            raise SpecError("ssh.key_file", key_file, "an existing private key file")
        known = v.get("known_hosts_file")
        if known is not None and not os.path.isdir(os.path.dirname(os.path.abspath(os.path.expanduser(str(known))))):
            raise SpecError("ssh.known_hosts_file", known, "a path in an existing directory")
        strict, timeout = option("strict_host_key_checking"), option("connect_timeout")
        for name, path in (("ssh.key_file", key_file), ("ssh.known_hosts_file", known)):
            # ssh -o values and ssh_config lines split on blanks and quotes: refuse rather than mis-split.
            if path is not None and any(c.isspace() or c in "\"'" for c in str(path)):
                raise SpecError(name, path, "a path without blanks or quotes")
        python, fanout, poll = option("python"), option("fanout"), option("poll_interval")
        max_poll = option("max_poll_interval", max(SETTINGS_TABLE["max_poll_interval"].default, poll))
        if max_poll < poll:
            raise SpecError("ssh.max_poll_interval", v.get("max_poll_interval"),
                            f"at least poll_interval ({poll:g} s)")
        lost_after = option("lost_after")
        return cls(user=user, port=port, key_file=None if key_file is None else os.path.abspath(os.path.expanduser(key_file)),
                   known_hosts_file=None if known is None else os.path.abspath(os.path.expanduser(known)),
                   strict_host_key_checking=strict, connect_timeout=timeout, python=python,
                   fanout=fanout, poll_interval=poll, max_poll_interval=max_poll, lost_after=lost_after)

    def login_port(self, host: HostEntry) -> int:
        """The port ``host``'s sshd listens on, for a probe that does not go through ssh (its line's
        port, else the settings', else 22: a port set only in ~/.ssh/config is unknown to the probe)."""
        return host.port or self.port or 22

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIELDS if getattr(self, name) is not None}


def from_airflow_connection(conn: Any) -> tuple[list[str], dict[str, Any]]:
    """Hosts and SSH settings from an Airflow SSH connection (duck-typed: no Airflow import).

    ``conn.host`` holds one host or a comma-separated list; ``extra`` may carry ``hosts``
    (hostfile lines, which then replace ``conn.host``), ``key_file``, ``known_hosts_file``,
    ``no_host_key_check`` (Airflow's SSH hook name), ``conn_timeout`` and ``python``.
    Inline ``private_key`` is refused: it would have to be written out; give a key_file.
    """
    extra = dict(getattr(conn, "extra_dejson", None) or {})
    if extra.get("private_key"):
        raise SpecError("ssh connection extra", "private_key", "a key_file path (inline keys are not written to disk)")
    hosts = extra.get("hosts") or [h.strip() for h in (conn.host or "").split(",") if h.strip()]
    if isinstance(hosts, str):
        hosts = [hosts]
    settings: dict[str, Any] = {}
    if getattr(conn, "login", None):
        settings["user"] = conn.login
    if getattr(conn, "port", None):
        settings["port"] = conn.port
    for key in ("key_file", "known_hosts_file", "python"):
        if extra.get(key):
            settings[key] = extra[key]
    if str(extra.get("no_host_key_check", "")).lower() == "true":
        settings["strict_host_key_checking"] = "no"
    if extra.get("conn_timeout"):
        settings["connect_timeout"] = extra["conn_timeout"]
    return list(hosts), settings


def select_hosts(entries: Sequence[HostEntry], nodes: int, procs_per_node: int, source: str,
                 spares: bool = False) -> list[HostEntry]:
    """The first ``nodes`` hosts, each with room for ``procs_per_node`` processes; with ``spares`` (an
    elastic job) every host listed: those beyond ``nodes`` stand by to replace a lost one."""
    if nodes > len(entries):
        raise SpecError("nodes", nodes, f"at most the {len(entries)} host(s) listed in {source}")
    chosen = list(entries if spares else entries[:nodes])
    for entry in chosen:
        if entry.slots is not None and procs_per_node > entry.slots:
            raise SpecError("procs_per_node", procs_per_node,
                            f"at most slots={entry.slots} of host {entry.host} ({source} line {entry.line})")
    return chosen


def hostfile_lines(entries: Iterable[HostEntry]) -> str:
    return "".join(f"{entry}\n" for entry in entries)


SETTINGS_OPTIONS = SSHSettings.FIELDS


@dataclass(frozen=True)
class SSHPlacement:
    """What the ssh backend's validate resolved from its options, kept on the spec (``spec.resolved``)
    and read from there: the hosts that run the job (node order) and the connection settings."""

    hosts: tuple[HostEntry, ...]
    settings: SSHSettings


def resolve_options(options: Mapping[str, Any], nodes: int, procs_per_node: int, spares: bool = False) -> SSHPlacement:
    """The hosts that run the job and the connection settings, from the ssh backend's options
    (``spares``: every host listed, see :func:`select_hosts`).

    ``hostfile`` (a path) or ``hosts`` (lines), and the :class:`SSHSettings` fields flat beside
    them. Every mistake names the option and surfaces before a process starts.
    """
    hostfile, hosts = options.get("hostfile"), options.get("hosts")
    if hostfile is not None and hosts is not None:
        raise SpecError("hosts", hosts, "give either hostfile or hosts, not both")
    if hostfile is None and hosts is None:
        raise SpecError("hostfile", None, "backend='ssh' needs a hostfile (or hosts): lines of " + TARGET_SYNTAX)
    if hostfile is not None:
        path = os.path.abspath(str(hostfile))
        entries, source = read_hostfile(path), f"hostfile {path}"
    else:
        entries, source = coerce_hosts(hosts), "hosts"
    chosen = select_hosts(entries, nodes, procs_per_node, source, spares)
    settings = SSHSettings.from_mapping({k: v for k, v in options.items() if k in SETTINGS_OPTIONS})
    return SSHPlacement(hosts=tuple(chosen), settings=settings)


def ssh_argv(settings: SSHSettings, host: HostEntry, remote_command: str, mux: Sequence[str] = ()) -> list[str]:
    """``ssh [options] -- HOST 'remote command'``; per-host user/port win over the settings'.
    ``mux``: connection-reuse options (see :mod:`.control`)."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={settings.strict_host_key_checking}",
            "-o", f"ConnectTimeout={settings.connect_timeout}",
            "-o", f"ServerAliveInterval={KEEPALIVE_S}", "-o", f"ServerAliveCountMax={settings.keepalive_count}",
            "-o", "LogLevel=ERROR", *mux]
    if settings.known_hosts_file:
        argv += ["-o", f"UserKnownHostsFile={settings.known_hosts_file}"]
    if settings.key_file:
        argv += ["-i", settings.key_file, "-o", "IdentitiesOnly=yes"]
    port = host.port or settings.port
    if port:
        argv += ["-p", str(port)]
    user = host.user or settings.user
    if user:
        argv += ["-l", user]
    return argv + ["--", host.address, remote_command]
