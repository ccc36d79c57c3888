"""Whether a peer's process still runs, without asking the peer: for peers on this host, its
/proc entry. A process is named by (host, pid, start time), so a pid the kernel reuses for
another process reads as gone. Peers on other hosts, or in another pid namespace (their /proc
entry is not theirs here), cannot be checked: for them only the bounded waits remain.

Linux only (/proc); elsewhere no peer is checkable.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

# /proc/<pid>/stat after the command's closing parenthesis: field 3 is the state, field 22 the
# start time in clock ticks since boot (proc(5)).
_STATE_FIELD, _START_FIELD = 0, 19
_GONE_STATES = ("Z", "X")  # a zombie or dead process has exited; only its entry remains


def _host_id() -> str:
    """This host: its name and the kernel's boot id (two containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of `pid` from /proc, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields[_STATE_FIELD], int(fields[_START_FIELD])


@dataclass(frozen=True)
class ProcessIdentity:
    """One process: its host, pid and start time (0 where /proc is missing)."""

    host: str
    pid: int
    start_time: int

    @staticmethod
    def mine() -> ProcessIdentity:
        stat = _stat(os.getpid())
        return ProcessIdentity(_host_id(), os.getpid(), stat[1] if stat else 0)

    def as_dict(self) -> dict:
        return {"host": self.host, "pid": self.pid, "start_time": self.start_time}

    @staticmethod
    def from_dict(d: dict) -> ProcessIdentity:
        return ProcessIdentity(str(d["host"]), int(d["pid"]), int(d["start_time"]))

    def checkable(self) -> bool:
        """True when this process can tell whether `self` runs: same host, and its /proc entry
        here is the same process (same start time: the same pid namespace)."""
        if self.start_time == 0 or self.host != _host_id():
            return False
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_time

    def alive(self) -> bool:
        """False once the process has exited (or its pid names another process). Only
        meaningful when `checkable()` was True at construction."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_time and stat[0] not in _GONE_STATES
