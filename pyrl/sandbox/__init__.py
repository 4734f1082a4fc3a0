"""Run untrusted code (a model's program, a tool call) in a child process under limits.

`run_code` / `run_code_async` run Python source in a fresh interpreter (`python -I -S -B`: the standard library
only, no environment variables or user paths, no bytecode written) whose working directory is a new temporary
directory holding `files`; the directory is removed afterwards whatever happened. The caller gets a SandboxResult:
a status, the (capped) output, and one line saying what happened. A reward function (code-execution scoring,
pyrl.rewards.code_exec) and a tool (pyrl.tools) call the same function; nothing here knows of Ray or the trainer.

The child is a small supervisor (pyrl/sandbox/_child.py) that forks the worker running the code and reports
how it ended; the worker lowers its limits, installs the audit hook and runs the code as `__main__`.

Protections, and when each holds
--------------------------------
Always:
- limits set in the worker before the code runs: CPU time (RLIMIT_CPU, whole seconds), address space
  (RLIMIT_AS), size of files written (RLIMIT_FSIZE), processes (RLIMIT_NPROC: see below for when the kernel
  enforces it), no core files; wall-clock time, enforced by the parent;
- the output is read with a cap: when stdout or stderr passes max_output_bytes the parent keeps that much and
  kills the process, so the parent's memory stays bounded;
- its own session and process group, killed with SIGKILL on timeout, on output overflow, on cancellation, when
  the code has exited (anything it left behind) and if the caller is interrupted; the parent never waits without
  a deadline;
- an environment of its own (PATH; HOME and TMPDIR = the sandbox directory; LANG): none of the parent's
  variables (credentials) reach the code;
- the audit hook (sys.addaudithook, installed before the code runs) refuses: starting programs (os.system,
  exec*, spawn*, posix_spawn, fork, forkpty, subprocess, _posixsubprocess); sockets other than local socket
  pairs (connect, bind, send, name lookups); ctypes; writing, creating, renaming, removing or changing files
  outside the sandbox directory (symbolic links and dir_fd= resolved; mknod and mkfifo, which raise no event,
  anywhere); signalling other processes; lifting the limits; the introspection that could reach the hook (gc
  referrers, settrace, other threads' frames). A refused operation raises PermissionError("pyrl.sandbox: ...
  is not allowed"); uncaught, the status is "blocked". A Python-level hook is defence in depth, not a
  boundary: C code making system calls itself is not seen (which is why ctypes is refused).
Where util-linux `unshare` can create namespaces (probed once per process):
- a network namespace of its own: no interface but a loopback that is down, so nothing is reachable even past
  the hook;
- a PID namespace whose init is the supervisor: when the code ends or is killed, the kernel kills every process
  it left, so nothing survives.
As root, the worker also drops to a uid (and gid) of this run's own, from 0x60000000 up (no user's), with no
supplementary groups, and the sandbox directory is made its own: the kernel then refuses writes wherever that
uid may not write, RLIMIT_NPROC counts this run's processes only, and runs cannot touch each other. (The
interpreter's directories are opened before the drop and imported from through /proc/self/fd, so this works
when Python lives where other uids cannot read, such as /root; the temporary directory, TMPDIR, must be one
other uids may pass through, as /tmp is.) If the drop is refused (no CAP_SETUID) the code runs as root:
RLIMIT_NPROC does not apply to root, and the file system is guarded by the audit hook alone.
Not root: the code runs as the calling user, in a user namespace along with the namespaces above when unshare
can make one, where RLIMIT_NPROC counts the sandbox's processes (Linux >= 5.14; before, all the user's); without
one it counts all the user's processes (so it is stricter, never looser). The file system is guarded by the audit
hook and the user's own permissions.
Without namespaces a process started past the hook that leaves the process group (setsid) could outlive the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import logging
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

log = logging.getLogger(__name__)

LANGUAGES = ("python",)
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "blocked")
BLOCK_PREFIX = "pyrl.sandbox: "  # _child.BLOCK_PREFIX: what a refused operation's message starts with
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
UNSHARE_FLAGS = ("--net", "--pid", "--fork", "--kill-child")  # the supervisor is the PID namespace's init
UID_BASE, UID_SPAN = 0x60000000, 1 << 24  # root: each run's own uid, in a range no user has
REAP_GRACE_S = 5.0  # after SIGKILL, how long to wait for the process to be reaped before giving up on it
READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock; on expiry the whole process tree is killed
    cpu_s: float = 10.0  # RLIMIT_CPU (rounded up to whole seconds, at least 1)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_processes: int = 32  # processes/threads the code may have (RLIMIT_NPROC)
    max_output_bytes: int = 65536  # stdout and stderr each; more is cut and the status says so
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE for files it writes

    def __post_init__(self):
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"SandboxLimits.{name}: expected a positive number of seconds, got {value!r}")
        for name in ("memory_mb", "max_processes", "max_output_bytes", "max_file_bytes"):
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

    def describe(self) -> str:
        parts = ["network and PID namespaces" if self.namespace else "no namespaces"]
        parts.append("a uid of its own" if self.drop_uid else f"uid {os.geteuid()}")
        return ", ".join(parts) + ", audit hook, resource limits"


def _probe(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd="/", env=_environment("/"), timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def isolation() -> Isolation:
    """What this machine allows, probed once: namespaces through unshare, the uid drop when root."""
    interpreter = [sys.executable, "-I", "-S", "-B", "-c"]
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    namespace: tuple[str, ...] = ()
    if unshare:
        # root makes the namespaces directly; a user needs a user namespace to own them
        candidate = (unshare, *(() if root else ("--map-root-user",)), *UNSHARE_FLAGS)
        if _probe([*candidate, *interpreter, "pass"]):
            namespace = candidate
    drop = root and _probe([*interpreter, f"import os; os.setgroups([]); os.setgid({UID_BASE}); "
                                          f"os.setuid({UID_BASE})"])
    found = Isolation(namespace, drop)
    log.info("pyrl.sandbox: %s", found.describe())
    if drop and not _traversable(tempfile.gettempdir()):
        log.warning("pyrl.sandbox: the code's uid cannot pass through %s: it reaches its directory only as its "
                    "working directory (absolute paths into it fail); set TMPDIR to a directory such as /tmp",
                    tempfile.gettempdir())
    return found


def _traversable(path: str) -> bool:
    """Whether any uid may pass through every directory down to `path`."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


_uids = itertools.count()


def _run_uid() -> int:
    """A uid no other run holds at the same time: this process's slot (by pid) and a counter within it."""
    return UID_BASE + ((os.getpid() % (UID_SPAN >> 10)) << 10 | next(_uids) % (1 << 10))


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


class _Run:
    """One execution: validated arguments, then `execute` (blocking, in any thread); `cancel` from another."""

    def __init__(self, code, language, stdin, limits, files):
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
    def execute(self) -> SandboxResult:
        start = time.monotonic()
        iso = isolation()
        root = tempfile.mkdtemp(prefix="pyrl-sandbox-")
        status_r = status_w = None
        try:
            work = os.path.join(root, "work")
            os.mkdir(work, 0o700)
            code_path = os.path.join(root, "main.py")
            with open(code_path, "w", encoding="utf-8") as f:
                f.write(self.code)
            uid = _run_uid() if iso.drop_uid else None
            self.write_files(work, uid)
            if uid is not None:
                os.chmod(root, 0o711)  # the worker may pass through (its absolute paths), not list or read
            status_r, status_w = os.pipe()
            settings = {"code": code_path, "work": work, "uid": uid, "status_fd": status_w,
                        "rlimits": self.rlimits(count_processes=uid is not None or os.geteuid() != 0)}
            argv = [*iso.namespace, sys.executable, "-I", "-S", "-B", "-X", "utf8", CHILD, json.dumps(settings)]
            with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no deadlock on large inputs
                stdin_file.write(self.stdin.encode("utf-8"))
                stdin_file.seek(0)
                with self.lock:
                    if self.cancelled:
                        return self.result("cancelled", None, b"", b"", start)
                    self.proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, cwd=work, env=_environment(work),
                                                 start_new_session=True, pass_fds=(status_w,))
            os.close(status_w)
            status_w = None
            reason, outputs, waited = self.communicate(start + self.limits.wall_s)
            if reason is None and self.cancelled:
                reason = "cancelled"
            os.set_blocking(status_r, False)
            try:
                report = os.read(status_r, 64).decode()
            except BlockingIOError:
                report = ""
            return self.result(reason, (report, waited), outputs["stdout"], outputs["stderr"], start)
        finally:
            self.kill()
            if self.proc is not None and not self.reaped:
                self.reap(time.monotonic() + REAP_GRACE_S)
            if self.proc is not None:
                self.proc.stdout.close()
                self.proc.stderr.close()
            for fd in (status_r, status_w):
                if fd is not None:
                    os.close(fd)
            _remove(root)

    def rlimits(self, count_processes: bool) -> dict[str, int]:
        limits = self.limits
        rlimits = {"RLIMIT_CPU": self.cpu_limit, "RLIMIT_AS": limits.memory_mb << 20,
                   "RLIMIT_FSIZE": limits.max_file_bytes, "RLIMIT_CORE": 0}
        if count_processes:  # root is exempt from RLIMIT_NPROC: nothing to set
            rlimits["RLIMIT_NPROC"] = limits.max_processes
        return rlimits

    def write_files(self, work: str, uid: int | None) -> None:
        if uid is not None:
            os.chown(work, uid, uid)
        for name, text in self.files.items():
            path = work
            for part in name.split("/")[:-1]:
                path = os.path.join(path, part)
                if not os.path.isdir(path):
                    os.mkdir(path, 0o700)
                    if uid is not None:
                        os.chown(path, uid, uid)
            path = os.path.join(work, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            if uid is not None:
                os.chown(path, uid, uid)

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
    def result(self, reason, ended, stdout: bytes, stderr: bytes, start: float) -> SandboxResult:
        limits = self.limits
        report, waited = ended if ended else ("", None)
        returncode = None
        kind, _, value = report.partition(" ")
        if kind == "exit":
            returncode = int(value)
        elif kind == "signal":
            returncode = -int(value)
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
        elif returncode is None:
            status, message = "killed", "the process ended without reporting how (killed from outside)"
        elif returncode < 0:
            name = _signal_name(-returncode)
            if -returncode in (signal.SIGKILL, signal.SIGXCPU) and cpu >= self.cpu_limit - 0.1:
                status, message = "timeout", f"CPU time limit of {self.cpu_limit} s exceeded: the process was killed"
            else:
                status, message = "killed", f"killed by signal {name}"
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
             files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` in the sandbox (blocking; safe from any thread). `files` are written into its working
    directory first (relative path -> text); `stdin` is its standard input. Errors in the arguments are
    ValueErrors naming the argument; whatever the code does is in the result."""
    return _Run(code, language, stdin, limits, files).execute()


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
MAX_CONCURRENT_ASYNC = 64  # runs of run_code_async going at once; more wait for a free thread


async def run_code_async(code: str, *, language: str = "python", stdin: str = "",
                         limits: SandboxLimits = SandboxLimits(),
                         files: dict[str, str] | None = None) -> SandboxResult:
    """run_code without blocking the event loop: the run waits in one of a pool of threads, so many can run at
    once. Cancelling the awaiting task kills the process at once."""
    global _executor
    run = _Run(code, language, stdin, limits, files)
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_ASYNC, thread_name_prefix="pyrl-sandbox")
    try:
        return await asyncio.get_running_loop().run_in_executor(_executor, run.execute)
    except asyncio.CancelledError:
        run.cancel()
        raise


__all__ = ["SandboxLimits", "SandboxResult", "run_code", "run_code_async", "isolation", "Isolation", "LANGUAGES",
           "STATUSES"]
