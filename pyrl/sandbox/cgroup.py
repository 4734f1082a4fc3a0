"""A cgroup per sandbox run: memory and process count over the run's whole process tree, enforced by the kernel.

cgroup v2 where this process's cgroup offers the memory and pids controllers to a child (root, or a delegated
subtree such as systemd's user@.service); else cgroup v1's memory and pids hierarchies where they are mounted and
writable (root in many containers). A run's cgroups are named pyrl-sandbox-<parent pid>-<n>; the parent removes
them after the run, and ones whose parent process is gone (killed with SIGKILL) are removed by the next process
that probes. Where neither works, the sandbox falls back to per-process limits (see pyrl.sandbox).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from dataclasses import dataclass

from pyrl.cgroups import mounts, oom_kill_count, own_paths, under

PREFIX = "pyrl-sandbox-"
_counter = itertools.count()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclass(frozen=True)
class Hierarchy:
    """Where runs' cgroups are made: one directory (v2) or one per controller (v1, memory and pids)."""

    version: int
    bases: tuple[str, ...]  # v2: (dir,); v1: (memory dir, pids dir)

    def create(self, memory_bytes: int, processes: int) -> "RunCgroup":
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        made = []
        try:
            for base in self.bases:
                path = os.path.join(base, name)
                os.mkdir(path)
                made.append(path)
            if self.version == 2:
                (path,) = made
                _write(f"{path}/memory.max", str(memory_bytes))
                if os.path.exists(f"{path}/memory.swap.max"):
                    _write(f"{path}/memory.swap.max", "0")
                _write(f"{path}/pids.max", str(processes))
            else:
                memory, pids = made
                _write(f"{memory}/memory.limit_in_bytes", str(memory_bytes))
                if os.path.exists(f"{memory}/memory.memsw.limit_in_bytes"):
                    _write(f"{memory}/memory.memsw.limit_in_bytes", str(memory_bytes))
                _write(f"{pids}/pids.max", str(processes))
        except OSError:
            RunCgroup(self.version, tuple(made)).remove()
            raise
        return RunCgroup(self.version, tuple(made))


@dataclass(frozen=True)
class RunCgroup:
    version: int
    paths: tuple[str, ...]

    @property
    def procs(self) -> list[str]:
        """The files the supervisor writes its pid to, joining every controller."""
        return [f"{path}/cgroup.procs" for path in self.paths]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for its memory limit."""
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        return bool(oom_kill_count(f"{self.paths[0]}/{events}"))

    def remove(self, within_s: float = 2.0) -> bool:
        """rmdir each (the kernel refuses while a process is still exiting: retried until `within_s`)."""
        deadline = time.monotonic() + within_s
        left = list(self.paths)
        while left:
            for path in list(left):
                try:
                    if self.version == 2 and os.path.exists(f"{path}/cgroup.kill"):
                        _write(f"{path}/cgroup.kill", "1")
                    elif self.version == 1:
                        _kill_members(path)
                    os.rmdir(path)
                    left.remove(path)
                except FileNotFoundError:
                    left.remove(path)
                except OSError:
                    pass
            if left:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        return True


def _kill_members(path: str) -> None:
    """cgroup v1 has no cgroup.kill: SIGKILL each process listed in the cgroup (one that left the run's process
    group or session would outlive it otherwise), through a pidfd taken before checking that the process is still a
    member, so that a pid reused meanwhile is never signalled."""
    name = "/" + os.path.basename(path)
    for pid in _read(f"{path}/cgroup.procs").split():
        try:
            pidfd = os.pidfd_open(int(pid))
        except OSError:
            continue
        try:
            if any(line.rsplit(":", 1)[-1].endswith(name) for line in _read(f"/proc/{pid}/cgroup").splitlines()):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(base: str) -> None:
    """Remove runs' cgroups whose parent process is gone (it was killed before it could)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        found = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
        if found and not _alive(int(found.group(1))):
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


def probe() -> Hierarchy | None:
    """The hierarchy runs' cgroups can be made in, checked by making (and removing) one; None when none works."""
    try:
        own, found = own_paths(), mounts()
    except (OSError, ValueError):
        return None
    candidates = []
    for fstype, root, point, options in found:
        if fstype == "cgroup2" and "" in own:
            rel = under(root, own[""])
            if rel is not None:
                candidates.append(Hierarchy(2, (point + rel.rstrip("/"),)))
    v1 = {}
    for fstype, root, point, options in found:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own:
                rel = under(root, own[controller])
                if rel is not None:
                    v1[controller] = point + rel.rstrip("/")
    if len(v1) == 2:
        candidates.append(Hierarchy(1, (v1["memory"], v1["pids"])))
    for hierarchy in candidates:
        for base in hierarchy.bases:
            remove_stale(base)
        try:
            if hierarchy.version == 2:
                controllers = _read(f"{hierarchy.bases[0]}/cgroup.subtree_control").split()
                if not {"memory", "pids"} <= set(controllers):
                    continue
            hierarchy.create(1 << 30, 64).remove()
        except OSError:
            continue
        return hierarchy
    return None
