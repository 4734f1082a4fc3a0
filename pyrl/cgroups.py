"""This process's cgroups, read from /proc: where each hierarchy holds it, where those are mounted, and the
kernel's OOM-kill count of its memory cgroup. Shared by the sandbox (pyrl.sandbox.cgroup, which makes cgroups
under this process's) and the controller's workers (which report the count, so an OOM kill can be told from another
SIGKILL once the process is gone)."""

from __future__ import annotations

import os
import re


def own_paths() -> dict[str, str]:
    """/proc/self/cgroup: controller (or "" for v2) -> this process's path in that hierarchy."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def mounts() -> list[tuple[str, str, str, set[str]]]:
    """/proc/self/mountinfo's cgroup mounts: (type, root within the hierarchy, mount point, super options)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f.read().splitlines():
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                found.append((fstype, fields[3], fields[4], options))
    return found


def under(mount_root: str, path: str) -> str | None:
    """`path` (a hierarchy path) relative to a mount of that hierarchy rooted at `mount_root`; None outside it."""
    if mount_root == "/":
        return path
    if path == mount_root or path.startswith(mount_root + "/"):
        return path[len(mount_root):] or "/"
    return None


def oom_kill_file() -> str | None:
    """The file whose `oom_kill N` line counts the kernel's OOM kills in this process's memory cgroup: memory.events
    (cgroup v2) or memory.oom_control (v1; its count is the cgroup's own, a child's kills are not in it); None where
    there is none."""
    try:
        own, found = own_paths(), mounts()
    except (OSError, ValueError):
        return None
    for fstype, root, point, options in found:
        key, name = ("", "memory.events") if fstype == "cgroup2" else ("memory", "memory.oom_control")
        if key not in own or (fstype == "cgroup" and "memory" not in options):
            continue
        rel = under(root, own[key])
        if rel is None:
            continue
        candidate = os.path.join(point + rel.rstrip("/"), name)
        if os.path.exists(candidate):
            return candidate
    return None


def oom_kill_count(path: str | None) -> int | None:
    """The `oom_kill` count in `path` (a memory.events or memory.oom_control file), or None."""
    try:
        with open(path) as f:
            found = re.search(r"^oom_kill (\d+)$", f.read(), re.M)
    except (OSError, TypeError):
        return None
    return int(found.group(1)) if found else None
