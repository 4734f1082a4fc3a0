"""What a sandbox run may leave on the host, looked for from outside: processes, the host directory of an
unisolated run, cgroups, SysV IPC objects; and the three ways the tests run the sandbox (the isolation modes).
Shared by test_sandbox.py and test_attacks.py (not a test module itself).

Processes are told apart from other users' (another test session may run the sandbox at the same time) by
ancestry: this process is made the subreaper of its descendants, so whatever a run leaves behind, even a daemon that
left its session, is re-parented here rather than to init and stays a descendant."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import os
import time

import pyrl.sandbox as sandbox
from pyrl.sandbox import UID_BASE, UID_SPAN, Isolation

MODES = ("isolated", "unisolated", "hook-only")
probed = sandbox.isolation  # the cached probe, kept before a test replaces sandbox.isolation
PR_SET_CHILD_SUBREAPER = 36
IPC_TABLES = ("shm", "msg", "sem")


def isolation_for(mode: str) -> Isolation:
    """isolated: what this machine allows (probed); unisolated: the same without namespaces (what a machine without
    unshare gets: the run's own uid, seccomp and the cgroup where possible); hook-only: the audit hook and the
    resource limits alone."""
    found = probed()
    if mode == "isolated":
        return found
    if mode == "unisolated":
        return dataclasses.replace(found, namespace=(), userns=False,
                                   missing=("namespaces (unshare: not found)",) + found.missing)
    if mode == "hook-only":
        return Isolation(namespace=(), drop_uid=False, missing=("namespaces (unshare: not found)",))
    raise ValueError(mode)


def unavailable(mode: str) -> str | None:
    """Why `mode` cannot be tested here, or None."""
    iso = probed()
    if mode == "isolated" and not iso.kernel_boundary:
        return f"no kernel boundary on this machine ({iso.describe()}; missing {'; '.join(iso.missing)})"
    return None


@contextlib.contextmanager
def using(mode: str):
    """sandbox.isolation() answers `mode` (for scripts; tests use monkeypatch)."""
    iso = isolation_for(mode)
    original = sandbox.isolation
    sandbox.isolation = lambda: iso
    try:
        yield iso
    finally:
        sandbox.isolation = original


def adopt_orphans(on: bool = True) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def _read(path: str, mode: str = "r"):
    with open(path, mode) as f:
        return f.read()


def _process(pid: int):
    """(state, ppid, real uid, cmdline bytes) or None when gone."""
    try:
        stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
        status = _read(f"/proc/{pid}/status")
        cmdline = _read(f"/proc/{pid}/cmdline", "rb")
    except (OSError, IndexError):
        return None
    uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)
    return stat[0], int(stat[1]), uid, cmdline


def processes(*markers: str, root: int | None = None) -> list[int]:
    """Live (not zombie) descendants of `root` (this process) that belong to a sandbox run: a uid of the runs'
    range, the supervisor's script on the command line, or one of `markers` there."""
    root = os.getpid() if root is None else root
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _process(int(name))
            if info is not None:
                table[int(name)] = info
    needles = [sandbox.SUPERVISOR_MARK.encode(), *(m.encode() for m in markers)]
    found = []
    for pid, (state, _, uid, cmdline) in table.items():
        if pid == root or state in "ZX":
            continue
        if not (UID_BASE <= uid < UID_BASE + UID_SPAN or any(n in cmdline for n in needles)):
            continue
        ancestor, hops = table[pid][1], 0
        while ancestor not in (root, 0, 1) and ancestor in table and hops < 1000:
            ancestor, hops = table[ancestor][1], hops + 1
        if ancestor == root:
            found.append(pid)
    return sorted(found)


def directories(pid: int | None = None) -> list[str]:
    """Host directories of unisolated runs made by process `pid` (this one) still there."""
    pid = os.getpid() if pid is None else pid
    return sorted(glob.glob(os.path.join(sandbox.work_base(), f"pyrl-sandbox-{pid}-*")))


def cgroups(pid: int | None = None) -> list[str]:
    """Runs' cgroups made by process `pid` (this one) still there, under the probed hierarchy's bases."""
    pid = os.getpid() if pid is None else pid
    hierarchy = probed().cgroup
    if hierarchy is None:
        return []
    return sorted(p for base in hierarchy.bases for p in glob.glob(os.path.join(base, f"pyrl-sandbox-{pid}-*")))


def ipc_objects() -> set[tuple[str, str]]:
    """SysV IPC objects (table, key and id) on the host."""
    found = set()
    for table in IPC_TABLES:
        try:
            lines = _read(f"/proc/sysvipc/{table}").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 2:
                found.add((table, f"{fields[0]}/{fields[1]}"))
    return found


def leftovers(*markers: str, within_s: float = 5.0) -> dict[str, list]:
    """What is still there after `within_s` (a cancelled run's thread may still be cleaning up): {} when nothing."""
    deadline = time.monotonic() + within_s
    while True:
        found = {"processes": processes(*markers), "directories": directories(), "cgroups": cgroups()}
        found = {k: v for k, v in found.items() if v}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
