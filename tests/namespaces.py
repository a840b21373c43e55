"""Hosts on one machine made of Linux namespaces (docs/DESIGN.md, "Testing across hosts on one
machine"), for the two-host tests and the recovery soak.

Each host is a network namespace with one interface ``eth0`` on a private /24 and a program run
in it under ``unshare --uts --pid --fork --kill-child --mount --mount-proc``: its own hostname,
PIDs and mounts. Two hosts are joined by a veth pair; more by a bridge in a namespace of its own
(the switch). :func:`made` deletes every namespace it made (and with them the links) when the
``with`` block ends, however it ends; a namespace dies with its last process, taking its mounts
with it. Where namespaces cannot be made, :class:`Refused` says why.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class Refused(Exception):
    """Namespaces cannot be made here (not root, a command missing, the kernel refused)."""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    names: tuple[str, ...]  # network namespaces, one per host
    ips: tuple[str, ...]
    hostnames: tuple[str, ...]
    hosts_file: Path  # bind-mounted over /etc/hosts in every host: they resolve each other

    def command(
        self,
        i: int,
        argv: Sequence[str],
        binds: Sequence[tuple[str | Path, str | Path]] = (),
        tmpfs: Sequence[str | Path] = (),
        exec_program: bool = True,
    ) -> list[str]:
        """The command line that runs ``argv`` on host ``i``. ``binds`` are ``(source, path)``
        bind mounts (a host's own directory over a path every host uses: a node-local disk
        only this host sees, which outlives its processes), ``tmpfs`` private file systems
        mounted over paths. ``exec_program=False`` keeps the shell as the PID namespace's init
        with ``argv`` its child, so a process of the host can SIGKILL every other one
        (``kill(-1)`` spares init) and the namespace ends once they are gone."""
        mounts = [
            "mount --make-rprivate /",
            f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts",
        ]
        mounts += [f"mount -t tmpfs tmpfs {shlex.quote(str(p))}" for p in tmpfs]
        mounts += [
            f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for src, dst in binds
        ]
        program = " ".join(shlex.quote(a) for a in argv)
        program = f"exec {program}" if exec_program else f"{program}; exit $?"
        script = " && ".join([f"hostname {shlex.quote(self.hostnames[i])}", *mounts, program])
        cmd = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--pid", "--fork"]
        return [*cmd, "--kill-child", "--mount", "--mount-proc", "bash", "-c", script]


@contextmanager
def made(hostnames: Sequence[str], workdir: str | Path, prefix: str = "ss") -> Iterator[Hosts]:
    """Make one network namespace per host name, linked, each with ``lo`` up; delete them all
    when the block ends. Raises :class:`Refused` (before making anything, or having removed
    what it made) where that is not possible here."""
    if len(hostnames) < 2:
        raise ValueError(f"hosts need at least two names, got {list(hostnames)}")
    if os.geteuid() != 0:
        raise Refused("namespaces need root (network and mount namespaces)")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise Refused(f"namespaces need the {tool!r} command")
    tag = uuid.uuid4().hex[:6]
    n = len(hostnames)
    names = tuple(f"{prefix}{i}{tag}" for i in range(n))
    switch = f"{prefix}w{tag}"
    octet = 16 + int(tag[:2], 16) % 200
    subnet = 213 if n == 2 else 214
    ips = tuple(f"10.{subnet}.{octet}.{i + 1}" for i in range(n))
    hosts_file = Path(workdir) / f"hosts-{tag}"
    hosts_file.write_text(
        "127.0.0.1 localhost\n"
        + "".join(f"{ip} {h}\n" for ip, h in zip(ips, hostnames, strict=True))
    )
    made_ns: list[str] = []
    try:
        try:
            for ns in names if n == 2 else (*names, switch):
                _run("ip", "netns", "add", ns)
                made_ns.append(ns)
            if n == 2:
                veth = (f"{prefix}va{tag}", f"{prefix}vb{tag}")
                _run("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
                ends = list(veth)
            else:
                _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
                _run("ip", "-n", switch, "link", "set", "br0", "up")
                ends = []
                for i in range(n):
                    host_end, switch_end = f"{prefix}h{i}{tag}", f"{prefix}s{i}{tag}"
                    _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                    _run("ip", "link", "set", switch_end, "netns", switch)
                    _run("ip", "-n", switch, "link", "set", switch_end, "master", "br0")
                    _run("ip", "-n", switch, "link", "set", switch_end, "up")
                    ends.append(host_end)
            for ns, dev, ip in zip(names, ends, ips, strict=True):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "link", "set", dev, "name", "eth0")
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            raise Refused(
                f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}"
            ) from e
        yield Hosts(names, ips, tuple(hostnames), hosts_file)
    finally:
        for ns in made_ns:  # a namespace takes its ends of the veth pairs with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # a veth made but not yet moved into a namespace (a failure in between)
        for dev in (f"{prefix}va{tag}", *(f"{prefix}h{i}{tag}" for i in range(n))):
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
        hosts_file.unlink(missing_ok=True)
