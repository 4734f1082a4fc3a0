"""Run untrusted code (a model's program, a tool call) behind a kernel-enforced boundary.

`run_code` / `run_code_async` run Python source in a fresh interpreter (`python -I -S -B`: the standard library
only, no environment variables or user paths, no bytecode written). The caller gets a SandboxResult: a status, the
(capped) output, and one line saying what happened. A reward function (code-execution scoring,
pyrl.rewards.code_exec) and a tool (pyrl.tools) call the same function; nothing here knows of Ray or the trainer.

How a run is isolated (README, "The sandbox", has the table of what is enforced by what):
- util-linux `unshare` puts the supervisor (pyrl/sandbox/_child.py) in new mount, PID, network, IPC and UTS
  namespaces (in a user namespace when not root); the supervisor is the PID namespace's init;
- the supervisor builds the run's file system (a read-only tmpfs root holding the host's /usr, /lib* and the
  standard library read-only, its own /etc and /dev, a new /proc; /sandbox, /tmp and /dev/shm writable on one tmpfs
  of max_disk_bytes) and pivots into it: nothing else of the host is there, and nothing of the run is on the host's
  disk (code, files and stdin come through memfds);
- it forks the worker, which drops to a uid of the run's own (root) or drops every capability (user namespace),
  sets no_new_privs and its rlimits, confines its file access with Landlock (where the kernel has it), loads a
  seccomp filter (libseccomp) and the audit hook (defence in depth), and is moved into a cgroup of the run's own
  (memory and processes over the whole tree) before the code starts;
- the parent kills the whole tree on timeout, output overflow or cancellation; the PID namespace ends with its
  init; a pipe whose write end only the parent holds ends the run when the parent dies, however it dies.
What this machine allows is probed once per process by real runs (`isolation()`). Without the namespaces, the
run's own uid (or a capability-less user namespace) and the seccomp filter, run_code refuses to run code
(SandboxUnavailable, naming what is missing) unless the caller passes allow_unisolated=True: then the code runs in a
host directory of its own with what remains (the uid drop as root; seccomp, then also refusing the host's SysV IPC
and unix-socket addresses; Landlock, which keeps its writes to that directory and its reads to the interpreter's
files; the cgroup; the audit hook; rlimits), one warning logged per process. The supervisor stands in for the
missing PID namespace and tmpfs: it kills every process of the run's uid when the run or the parent ends, and
measures the directory against the disk quota every DISK_POLL_S (_child.py). Such a run's directory is removed
afterwards, or, if its process was killed first, by its supervisor (failing that, by the next process that
probes); a killed process's cgroups by the next process that probes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import marshal
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from pyrl.sandbox import cgroup as _cgroup

log = logging.getLogger(__name__)

LANGUAGES = ("python",)
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "blocked")
BLOCK_PREFIX = "pyrl.sandbox: "  # _child.BLOCK_PREFIX: what a refused operation's message starts with
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
PYTHON = os.path.realpath(sys.executable)  # a virtual environment's link resolved: no project path in the run
SUPERVISOR_MARK = "pyrl-sandbox-supervisor"  # on the supervisor's command line (its script comes through a memfd)
NAMESPACES = ("--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child")  # supervisor = PID 1
MOUNT_BASE = "/tmp"  # the host directory the run's tmpfs is mounted over, inside its own mount namespace only
# root: each run's own uid, UID_BASE + (this process's pid << 8 | a slot free in this process), in a range no user
# has: two live processes never share a pid, and a process never gives one slot to two runs at once
UID_BASE, UID_SPAN = 0x40000000, 1 << 30
UID_SLOTS = 256  # runs at once in one process
REAP_GRACE_S = 5.0  # after SIGKILL, how long to wait for the process to be reaped before giving up on it
READ_CHUNK = 1 << 16
SETUP_EXIT = 70  # the supervisor's or the worker's exit code when setting up the run failed (reported, not code's)


class SandboxUnavailable(RuntimeError):
    """This machine cannot give untrusted code a kernel-enforced boundary, and running without one was not
    allowed (allow_unisolated / reward.sandbox.allow_unisolated). Never scored as a failed program: it stops."""


class SandboxError(RuntimeError):
    """Setting up a run failed (a mount, the cgroup, the privilege drop): the sandbox's fault, not the code's."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock; on expiry the whole process tree is killed
    cpu_s: float = 10.0  # RLIMIT_CPU (rounded up to whole seconds, at least 1)
    memory_mb: int = 1024  # the whole tree's memory (cgroup); also each process's address space (RLIMIT_AS)
    max_processes: int = 32  # processes/threads the code may have (pids cgroup, RLIMIT_NPROC)
    max_output_bytes: int = 65536  # stdout and stderr each; more is cut and the status says so
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE for files it writes
    max_disk_bytes: int = 64 << 20  # the run's tmpfs (its directory, /tmp and /dev/shm together)
    max_open_files: int = 1024  # RLIMIT_NOFILE per process (the host's file table is shared by every run)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"SandboxLimits.{name}: expected a positive number of seconds, got {value!r}")
        for name in ("memory_mb", "max_processes", "max_output_bytes", "max_file_bytes", "max_disk_bytes",
                     "max_open_files"):
            value = getattr(self, name)
            least = 0 if name == "max_file_bytes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SandboxLimits.{name}: expected an integer >= {least}, got {value!r}")


@dataclass
class SandboxResult:
    status: str  # one of STATUSES
    returncode: int | None  # the exit code, -N for signal N, None when it was killed by the parent or unknown
    stdout: str
    stderr: str
    wall_s: float
    message: str  # one line a human (or a model, as a tool response) can read: what happened

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated on this machine (see the module docstring)."""

    namespace: tuple[str, ...]  # the unshare command line put before the interpreter; () for none
    drop_uid: bool  # root: the worker drops to a uid of the run's own
    userns: bool = False  # not root: the namespaces belong to a user namespace whose root drops every capability
    seccomp: bool = False  # the worker loads the seccomp filter (libseccomp)
    cgroup: "_cgroup.Hierarchy | None" = None  # where the run's memory and process cgroups are made
    missing: tuple[str, ...] = ()  # what the kernel refused, for the default-deny message
    landlock: int = 0  # the Landlock ABI version the worker restricts itself with (0: none)

    @property
    def kernel_boundary(self) -> bool:
        """Whether the kernel, not the audit hook, confines the code: namespaces (mount, PID, network, IPC,
        UTS), its own uid or a capability-less user-namespace root, and the seccomp filter."""
        return bool(self.namespace) and self.seccomp and (self.drop_uid or self.userns)

    def describe(self) -> str:
        if self.namespace:
            parts = ["mount, PID, network, IPC and UTS namespaces" + (" in a user namespace" if self.userns else "")]
        else:
            parts = ["no namespaces"]
        parts.append("a uid of its own" if self.drop_uid else
                     ("no capabilities" if self.userns else f"uid {os.geteuid()}"))
        parts.append("seccomp filter" if self.seccomp else "no seccomp filter")
        parts.append(f"Landlock ABI {self.landlock}" if self.landlock else "no Landlock")
        parts.append(f"cgroup v{self.cgroup.version} memory and process limits over the tree" if self.cgroup
                     else "per-process memory and process limits (no cgroup)")
        return ", ".join(parts) + ", audit hook"


@functools.cache
def isolation() -> Isolation:
    """What this machine allows, probed once by real runs of `pass`: the namespaces through util-linux unshare
    (a user namespace when not root), the uid drop when root, the seccomp filter, a cgroup per run."""
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    hierarchy = _cgroup.probe()
    missing = []
    namespace: tuple[str, ...] = ()
    if not unshare:
        missing.append("util-linux unshare (namespaces)")
    else:
        candidate = (unshare, *(() if root else ("--user", "--map-root-user")), *NAMESPACES)
        error = _probe(Isolation(candidate, root, not root, False, None))
        if error is None:
            namespace = candidate
        else:
            missing.append(f"namespaces ({error})")
    drop = root and _probe(Isolation((), True, False, False, None)) is None
    if root and not drop:
        missing.append("a uid of the run's own (setuid refused)")
    seccomp_error = _probe(Isolation(namespace, drop, bool(namespace) and not root, True, None))
    if seccomp_error is not None:
        missing.append(f"seccomp through libseccomp ({seccomp_error})")
    if hierarchy is not None and _probe(Isolation(namespace, drop, bool(namespace) and not root, False,
                                                  hierarchy)) is not None:
        hierarchy = None
    landlock = _landlock_abi()
    if landlock and _probe(Isolation(namespace, drop, bool(namespace) and not root, False, None,
                                     landlock=landlock)) is not None:
        landlock = 0
    found = Isolation(namespace, drop, bool(namespace) and not root, seccomp_error is None, hierarchy,
                      tuple(missing), landlock)
    log.info("pyrl.sandbox: %s", found.describe())
    if not namespace:
        _remove_stale_directories()
    return found


def _landlock_abi() -> int:
    """The Landlock ABI version this kernel offers (landlock_create_ruleset's version query), 0 without one."""
    version = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), 1)  # ..._VERSION
    return max(0, version)


def _probe(candidate: Isolation) -> str | None:
    """None when a run of `pass` under `candidate` works, else why not (one line)."""
    try:
        result = _Run("pass", "python", "", SandboxLimits(wall_s=30, cpu_s=5), None, True).execute(candidate)
    except SandboxError as e:
        return str(e).splitlines()[0][:300]
    except OSError as e:
        return f"{type(e).__name__}: {e}"[:300]
    return None if result.ok else result.message[:300]


_warned_unisolated = False


def check_isolation(allow_unisolated: bool = False) -> Isolation:
    """This machine's isolation; raises SandboxUnavailable when it has no kernel boundary and allow_unisolated is
    false (callers that will run code call it at start, to stop a run before it begins)."""
    iso = isolation()
    _check_isolation(iso, allow_unisolated)
    return iso


def _check_isolation(iso: Isolation, allow_unisolated: bool) -> None:
    global _warned_unisolated
    if iso.kernel_boundary:
        return
    if not allow_unisolated:
        raise SandboxUnavailable(
            "pyrl.sandbox: this machine cannot put untrusted code behind a kernel boundary: missing "
            + "; ".join(iso.missing or ("namespaces",)) + ". Refusing to run it. To run it anyway with "
            "the audit hook and resource limits only (a hook code can walk around), set "
            "reward.sandbox.allow_unisolated=true (code rewards) or allow_unisolated: true (the code_interpreter "
            "tool's config), or pass allow_unisolated=True to run_code")
    if not _warned_unisolated:
        _warned_unisolated = True
        log.warning("pyrl.sandbox: running untrusted code WITHOUT a kernel boundary (allow_unisolated): %s; "
                    "missing %s", iso.describe(), "; ".join(iso.missing))


@functools.cache
def work_base() -> str:
    """Where unisolated runs' directories are made: /dev/shm where it is a tmpfs, because tmpfs pages are charged to
    the memory cgroup of the process that writes them, so even a file deleted while held open (which no scan of the
    directory sees) counts against the run's memory_mb; else the temporary directory."""
    try:
        with open("/proc/self/mounts") as f:
            if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f) and os.access("/dev/shm", os.W_OK):
                return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def _remove_stale_directories() -> None:
    """Unisolated runs' host directories whose process was killed before it could remove them."""
    base = work_base()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("pyrl-sandbox-") and len(parts) >= 4 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                _remove(os.path.join(base, name))
            except PermissionError:
                pass


_uid_slots: set[int] = set()
_uid_lock = threading.Lock()


def _take_uid() -> int:
    """A uid no other run holds at the same time (see UID_BASE); _release_uid gives it back."""
    with _uid_lock:
        slot = next((k for k in range(UID_SLOTS) if k not in _uid_slots), None)
        if slot is None:
            raise SandboxError(f"pyrl.sandbox: more than {UID_SLOTS} runs at once in one process")
        _uid_slots.add(slot)
    return UID_BASE + (os.getpid() << 8 | slot)


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uid_slots.discard(uid & (UID_SLOTS - 1))


def _environment(work: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}


def _check_files(files) -> dict[str, str]:
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise ValueError(f"files: expected a dict of relative path -> text, got {type(files).__name__}")
    for name, text in files.items():
        parts = name.split("/") if isinstance(name, str) else []
        if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"files: {name!r} is not a relative path inside the sandbox directory (no '..', "
                             "no leading or doubled '/')")
        if "\0" in name or any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
            raise ValueError(f"files: {name!r} has a NUL character or a component longer than 255 bytes")
        if any("/".join(parts[:k]) in files for k in range(1, len(parts))):
            raise ValueError(f"files: {name!r} is inside {'/'.join(parts[:-1])!r}, which is also given as a file")
        if not isinstance(text, str):
            raise ValueError(f"files[{name!r}]: expected text (str), got {type(text).__name__}")
    return files


def _remove(path: str) -> None:
    """Remove the sandbox directory, also when the code took away its own permissions on parts of it."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("pyrl.sandbox: could not remove %s", path)


@functools.cache
def _child_source() -> bytes:
    with open(CHILD, "rb") as f:
        return f.read()


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start: nothing of the run on the host's disk."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Run:
    """One execution: validated arguments, then `execute` (blocking, in any thread); `cancel` from another."""

    def __init__(self, code, language, stdin, limits, files, allow_unisolated=False, audit_hook=True):
        # audit_hook=False: pyrl's attack tests only, standing for code that found a way around the hook
        self.allow_unisolated, self.audit_hook = allow_unisolated, audit_hook
        if not isinstance(language, str) or language not in LANGUAGES:
            raise ValueError(f"language: {language!r} is not supported; supported: {', '.join(LANGUAGES)}")
        if not isinstance(code, str):
            raise ValueError(f"code: expected the program's source text (str), got {type(code).__name__}")
        if not isinstance(stdin, str):
            raise ValueError(f"stdin: expected text (str), got {type(stdin).__name__}")
        if not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits: expected a pyrl.sandbox.SandboxLimits, got {type(limits).__name__}")
        self.code, self.stdin, self.limits, self.files = code, stdin, limits, _check_files(files)
        self.cpu_limit = max(1, math.ceil(limits.cpu_s))
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.reaped = False
        self.cancelled = False

    # ---- killing ----
    def kill(self) -> None:
        """SIGKILL the whole process group (and with the supervisor, the PID namespace), unless already reaped."""
        with self.lock:
            if self.proc is not None and not self.reaped:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
        self.kill()

    # ---- the run ----
    def execute(self, iso: Isolation | None = None) -> SandboxResult:
        """Run the code under `iso` (this machine's isolation unless given: the probe passes candidates)."""
        start = time.monotonic()
        if iso is None:
            iso = isolation()
            _check_isolation(iso, self.allow_unisolated)
        work = None if iso.namespace else tempfile.mkdtemp(prefix=f"pyrl-sandbox-{os.getpid()}-", dir=work_base())
        group = uid = None
        fds: list[int] = []
        try:
            uid = _take_uid() if iso.drop_uid else None  # the supervisor makes the directory the uid's, files written
            if iso.cgroup is not None:
                group = iso.cgroup.create(self.limits.memory_mb << 20, self.limits.max_processes)
            count_processes = uid is not None or iso.userns or os.geteuid() != 0  # root is exempt from NPROC
            settings = {"source": self.code, "files": self.files, "uid": uid, "userns": iso.userns,
                        "seccomp": iso.seccomp, "cgroups": group.procs if group else [],
                        "mount_base": MOUNT_BASE if iso.namespace else None, "work": work,
                        "disk_bytes": self.limits.max_disk_bytes, "rlimits": self.rlimits(count_processes),
                        "audit_hook": self.audit_hook, "landlock": iso.landlock}
            settings_fd = _memfd("pyrl-sandbox-settings", marshal.dumps(settings))
            fds.append(settings_fd)
            stdin_fd = _memfd("pyrl-sandbox-stdin", self.stdin.encode("utf-8"))  # a file: no deadlock on large input
            fds.append(stdin_fd)
            status_r, status_w = os.pipe()
            fds += [status_r, status_w]
            lifeline_r, lifeline_w = os.pipe()  # the write end closes when this process ends, however it ends
            fds += [lifeline_r, lifeline_w]
            child_fd = _memfd("pyrl-sandbox-child", _child_source())  # no host path on the run's command line
            fds.append(child_fd)
            argv = [*iso.namespace, PYTHON, "-I", "-S", "-B", "-X", "utf8", f"/proc/self/fd/{child_fd}",
                    SUPERVISOR_MARK, str(settings_fd), str(status_w), str(lifeline_r)]
            with self.lock:
                if self.cancelled:
                    return self.result("cancelled", None, b"", b"", start, group)
                self.proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             cwd=work or "/", env=_environment(work or "/sandbox"),
                                             start_new_session=True,
                                             pass_fds=(child_fd, settings_fd, status_w, lifeline_r))
            for fd in (child_fd, settings_fd, stdin_fd, status_w, lifeline_r):
                os.close(fd)
                fds.remove(fd)
            reason, outputs, waited = self.communicate(start + self.limits.wall_s)
            if reason is None and self.cancelled:
                reason = "cancelled"
            os.set_blocking(status_r, False)
            try:
                report = os.read(status_r, 8192).decode("utf-8", "replace")
            except BlockingIOError:
                report = ""
            if report.startswith("setup "):
                raise SandboxError(f"pyrl.sandbox: setting up the run failed ({iso.describe()}): "
                                   f"{report[6:].split('exit ')[0].strip()}")
            return self.result(reason, (report, waited), outputs["stdout"], outputs["stderr"], start, group)
        finally:
            self.kill()
            if self.proc is not None and not self.reaped:
                self.reap(time.monotonic() + REAP_GRACE_S)
            if self.proc is not None:
                self.proc.stdout.close()
                self.proc.stderr.close()
            for fd in fds:
                os.close(fd)
            if uid is not None:
                if not iso.namespace and group is None:  # nothing else ends a daemon that left the process group
                    _kill_uid(uid)
                _release_uid(uid)
            if group is not None and not group.remove():
                log.warning("pyrl.sandbox: could not remove cgroup %s", ", ".join(group.paths))
            if work is not None:
                _remove(work)

    def rlimits(self, count_processes: bool) -> dict[str, int]:
        limits = self.limits
        rlimits = {"RLIMIT_CPU": self.cpu_limit, "RLIMIT_AS": limits.memory_mb << 20,
                   "RLIMIT_FSIZE": min(limits.max_file_bytes, limits.max_disk_bytes), "RLIMIT_CORE": 0,
                   "RLIMIT_NOFILE": limits.max_open_files}
        if count_processes:  # root is exempt from RLIMIT_NPROC: nothing to set
            rlimits["RLIMIT_NPROC"] = limits.max_processes
        return rlimits

    def communicate(self, deadline: float):
        """Read stdout and stderr (each up to the cap) until both close and the child has exited, or until the
        deadline or an overflow: -> (reason or None, {"stdout": bytes, "stderr": bytes}, wait4 result or None)."""
        proc, cap = self.proc, self.limits.max_output_bytes
        streams = {proc.stdout.fileno(): ("stdout", bytearray()), proc.stderr.fileno(): ("stderr", bytearray())}
        selector = selectors.DefaultSelector()
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        open_streams, waited, reason = len(streams), None, None
        try:
            while open_streams or waited is None:
                if waited is None and pidfd is None and self.exited():
                    self.kill_leftovers()
                    waited = self.wait(0)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    reason = "timeout"
                    break
                # without a pidfd the exit is noticed by polling
                for key, _ in selector.select(remaining if pidfd is not None else min(remaining, 0.05)):
                    if key.fd == pidfd:
                        selector.unregister(pidfd)
                        self.kill_leftovers()
                        waited = self.wait(0)
                        continue
                    chunk = os.read(key.fd, READ_CHUNK)
                    if not chunk:
                        selector.unregister(key.fd)
                        open_streams -= 1
                        continue
                    name, buffer = streams[key.fd]
                    room = cap - len(buffer)
                    buffer += chunk[:room]
                    if len(chunk) > room:
                        reason = f"output_limit {name}"
                if reason:
                    break
        finally:
            selector.close()
            if pidfd is not None:
                os.close(pidfd)
        return reason, {name: bytes(buffer) for name, buffer in streams.values()}, waited

    def exited(self) -> bool:
        """Whether the child has exited, leaving it unreaped (without a pidfd)."""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill_leftovers(self) -> None:
        """The main process has exited but is not reaped yet, so its process group id cannot have been reused:
        whatever the code left in the group goes too (in a PID namespace the kernel did that already)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, flags: int):
        """os.wait4 on the child (its rusage includes the supervisor's and the worker's CPU time), or None."""
        try:
            pid, status, usage = os.wait4(self.proc.pid, flags)
        except ChildProcessError:  # reaped by someone else (a SIGCHLD handler): no status to read
            pid, status, usage = self.proc.pid, None, None
        if pid == 0:
            return None
        with self.lock:
            self.reaped = True
        # for Popen's bookkeeping (it also says 0 when the status is lost); the result reads the supervisor's report
        self.proc.returncode = os.waitstatus_to_exitcode(status) if status is not None else 0
        return status, usage

    def reap(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.wait(os.WNOHANG) is not None:
                return
            time.sleep(0.01)
        log.warning("pyrl.sandbox: process %d did not end %.0f s after SIGKILL", self.proc.pid, REAP_GRACE_S)

    # ---- the outcome ----
    def result(self, reason, ended, stdout: bytes, stderr: bytes, start: float, group=None) -> SandboxResult:
        limits = self.limits
        report, waited = ended if ended else ("", None)
        returncode = None
        kind, _, value = report.partition(" ")
        if kind in ("exit", "signal") and value.isdigit():  # anything else (a report forged past the hook) is unknown
            returncode = int(value) if kind == "exit" else -int(value)
        cpu = waited[1].ru_utime + waited[1].ru_stime if waited and waited[1] is not None else 0.0
        last = next((line.strip() for line in reversed(stderr.decode("utf-8", "replace").splitlines())
                     if line.strip()), "")
        if reason and reason.startswith("output_limit"):
            stream = reason.split()[1]
            status, message = "output_limit", (f"{stream} passed the limit of {limits.max_output_bytes} bytes: "
                                               "the output is cut there and the process was killed")
            returncode = None
        elif reason == "timeout":
            status, message = "timeout", f"wall-clock limit of {limits.wall_s:g} s exceeded: the process was killed"
            returncode = None
        elif reason == "cancelled":
            status, message, returncode = "killed", "cancelled by the caller: the process was killed", None
        elif kind == "disk" and value.isdigit():
            status, message = "killed", (f"disk quota of {limits.max_disk_bytes >> 20} MiB exceeded ({int(value) >> 20}"
                                         " MiB in its directory): the process was killed")
        elif returncode is None:
            status, message = "killed", "the process ended without reporting how (killed from outside)"
        elif returncode < 0 and not (group is not None and group.oom_killed()):
            name = _signal_name(-returncode)
            if -returncode in (signal.SIGKILL, signal.SIGXCPU) and cpu >= self.cpu_limit - 0.1:
                status, message = "timeout", f"CPU time limit of {self.cpu_limit} s exceeded: the process was killed"
            else:
                status, message = "killed", f"killed by signal {name}"
        elif group is not None and group.oom_killed():
            status, message = "memory", (f"memory limit of {limits.memory_mb} MB over the whole process tree "
                                         "exceeded: the kernel killed a process of the run")
        elif returncode == 0:
            status, message = "ok", "exited normally (code 0)"
        elif last.startswith("MemoryError"):
            status, message = "memory", f"memory limit of {limits.memory_mb} MB exceeded ({last[:200]})"
        elif BLOCK_PREFIX in last:  # the refusal, raised as is or wrapped (urllib's URLError)
            refused = last.split(BLOCK_PREFIX, 1)[1]
            end = refused.find(" is not allowed")
            status, message = "blocked", "blocked: " + (refused[:end + 15] if end >= 0 else refused)[:200]
        else:
            status, message = "error", f"exited with code {returncode}" + (f": {last[:200]}" if last else "")
        return SandboxResult(status=status, returncode=returncode, stdout=stdout.decode("utf-8", "replace"),
                             stderr=stderr.decode("utf-8", "replace"), wall_s=time.monotonic() - start,
                             message=message)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of a run's uid (root only), as the supervisor does when it can (_child.kill_uid): for an
    unisolated run without a cgroup whose supervisor was killed first (timeout, output cap, cancellation)."""
    sweep = f"import os\nos.setgroups([])\nos.setgid({uid})\nos.setuid({uid})\nfor _ in range(3): os.kill(-1, 9)"
    subprocess.run([PYTHON, "-I", "-S", "-c", sweep], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd="/", env={}, timeout=30)  # started as root: the binary is readable


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_code(code: str, *, language: str = "python", stdin: str = "", limits: SandboxLimits = SandboxLimits(),
             files: dict[str, str] | None = None, allow_unisolated: bool = False) -> SandboxResult:
    """Run `code` in the sandbox (blocking; safe from any thread). `files` are written into its working
    directory first (relative path -> text); `stdin` is its standard input. Errors in the arguments are
    ValueErrors naming the argument; whatever the code does is in the result."""
    return _Run(code, language, stdin, limits, files, allow_unisolated).execute()


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
MAX_CONCURRENT_ASYNC = 64  # runs of run_code_async going at once; more wait for a free thread


async def run_code_async(code: str, *, language: str = "python", stdin: str = "",
                         limits: SandboxLimits = SandboxLimits(),
                         files: dict[str, str] | None = None, allow_unisolated: bool = False) -> SandboxResult:
    """run_code without blocking the event loop: the run waits in one of a pool of threads, so many can run at
    once. Cancelling the awaiting task kills the process at once."""
    global _executor
    run = _Run(code, language, stdin, limits, files, allow_unisolated)
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_ASYNC, thread_name_prefix="pyrl-sandbox")
    try:
        return await asyncio.get_running_loop().run_in_executor(_executor, run.execute)
    except asyncio.CancelledError:
        run.cancel()
        raise


__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "SandboxError", "run_code", "run_code_async",
           "isolation", "check_isolation", "Isolation", "LANGUAGES", "STATUSES"]
