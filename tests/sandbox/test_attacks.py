"""Attacks on pyrl.sandbox, each run in every isolation mode and judged from evidence OUTSIDE the program: files on
the host, secrets showing up in the output, processes still alive, SysV IPC objects, a bystander process killed,
connections reaching a listener of this process, the result run_code returns.

The modes (sandbox_leftovers.isolation_for): "isolated" is what this machine allows (namespaces, the run's own uid,
seccomp, a cgroup); "unisolated" the same without namespaces (a machine without unshare); "hook-only" the audit hook
and the resource limits alone (root, no seccomp). Many attacks first get past the audit hook (`past_hook` below: a
subinterpreter, whose code the main interpreter's hook never sees, or a fresh interpreter started through a second
copy of _posixsubprocess), because the hook is defence in depth and the question is what the kernel contains.

EXPECTED holds the verdicts: attack -> outcome per mode, "contained" or "escapes"; "escapes" only where the mode
honestly cannot contain the attack. A test asserts that the observed outcome is the expected one, so a regression
in either direction fails. Run as a script to print the observed table as markdown:

    python tests/sandbox/test_attacks.py

The evidence for the seccomp rows is the error number the refused system call returns inside the run (there is
nothing outside to look at); everything else is judged from this process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sandbox_leftovers, also when run as a script

from sandbox_leftovers import (  # noqa: E402
    MODES,
    adopt_orphans,
    cgroups,
    directories,
    ipc_objects,
    isolation_for,
    leftovers,
    processes,
    unavailable,
    using,
)

import pyrl  # noqa: E402
import pyrl.sandbox as sandbox  # noqa: E402
from pyrl.sandbox import SandboxLimits, cgroup  # noqa: E402

C, E = "contained", "escapes"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(pyrl.__file__)))
HOME = os.path.expanduser("~")
LIMITS = SandboxLimits(wall_s=10, cpu_s=5, memory_mb=256, max_processes=32, max_output_bytes=1 << 16)
REFUSED = {errno.EPERM, errno.EACCES, errno.EAFNOSUPPORT, errno.ENOSYS}  # how the filter and the kernel refuse

# attack -> (isolated, unisolated, hook-only)
EXPECTED = {
    # 1. the audit hook bypassed wholesale, then the kernel's turn
    "past the hook: write a file in host /tmp": (C, C, E),
    "past the hook: write a file in host /dev/shm (POSIX shared memory)": (C, C, E),
    "past the hook: write a file in the repository": (C, C, E),
    "past the hook: write a file in the home directory": (C, C, E),
    "past the hook: SysV message queue": (C, C, E),
    "past the hook: a daemon (double fork, setsid) outliving the run": (C, C, E),
    "past the hook: 4 processes x 200 MB against a 256 MB limit": (C, C, E),
    "past the hook: connect to a world-writable unix socket in host /tmp": (C, C, E),
    "past the hook: connect to an abstract unix socket of the host": (C, C, E),
    "past the hook: TCP to a listener on 127.0.0.1": (C, C, E),
    "past the hook: UDP to a socket on 127.0.0.1": (C, C, E),
    # 2. climbing out of the work directory with dir_fd= (the "open" audit event carries no dir_fd)
    "dir_fd climb: write in host /tmp": (C, C, E),
    "dir_fd climb: write in host /dev/shm": (C, C, E),
    "dir_fd climb: write in the repository": (C, C, E),
    "dir_fd climb: write in the home directory": (C, C, E),
    # 3. writers in C that raise no audit event
    "sqlite ATTACH DATABASE in host /tmp": (C, C, E),
    "sqlite VACUUM INTO host /tmp": (C, C, E),
    "readline.write_history_file in host /tmp": (C, C, E),
    "_posixshmem.shm_open (host /dev/shm)": (C, C, E),
    "a fresh posix module (_imp.create_builtin): mkfifo in host /tmp": (C, C, E),
    "a fresh posix module: mknod of /dev/kmsg (1, 11), then writing to the host's kernel log": (C, C, E),
    # 4. reads
    "read /etc/shadow": (C, C, E),
    "read a bystander's /proc/<pid>/environ": (C, C, E),
    "find a secret on a host command line (/proc/*/cmdline)": (C, C, E),
    "read a file of the repository (README.md)": (C, C, E),
    "read a file in the home directory": (C, C, E),
    # 5. signalling processes outside, forging the supervisor's report
    "kill a bystander (os.kill, the hook in the way)": (C, C, C),
    "past the hook: kill a bystander (os.kill)": (C, C, E),
    "past the hook: kill a bystander (pidfd_open + pidfd_send_signal)": (C, C, E),
    "forge the status report on inherited descriptors 3..63": (C, C, C),
    "past the hook: forge the status report through /proc/<supervisor>/fd": (C, C, E),
    # 6. two runs at once
    "a run finds or changes the files of a run going on at the same time": (C, C, E),
    # 7. disk
    "write 128 MiB with a disk quota of 32 MiB": (C, C, C),  # hook-only: the hook keeps its writes in its directory
    "write 192 MiB into files deleted while held open (quota 32 MiB, memory 96 MB)": (C, C, E),
    # 8. the kernel's attack surface (evidence: the error number inside the run)
    "past the hook: ptrace (attach to its own child)": (C, C, E),
    "past the hook: unshare(CLONE_NEWUSER)": (C, C, E),
    "past the hook: clone(CLONE_NEWUSER)": (C, C, E),
    "past the hook: mount": (C, C, E),
    "past the hook: bpf": (C, C, E),
    "past the hook: keyctl": (C, C, E),
    "past the hook: io_uring_setup": (C, C, E),
    "past the hook: perf_event_open": (C, C, E),
    "past the hook: socket(AF_INET)": (C, C, E),
    "past the hook: socket(AF_NETLINK)": (C, C, E),
    "past the hook: socket(AF_PACKET)": (C, C, E),
    "past the hook: io_setup (AIO contexts count against a host-wide limit)": (C, C, E),
    "past the hook: listmount (Linux 6.8, newer than the libseccomp that builds the filter)": (C, C, E),
    # the audit hook's own refusals (defence in depth)
    "the hook refuses a subinterpreter (whose audit hooks would be its own)": (C, C, C),
    "the hook refuses _posixsubprocess loaded under another name": (C, C, C),
    # 9. nothing left behind
    "leftovers after a normal run": (C, C, C),
    "past the hook: children of a run killed at its wall-clock limit": (C, C, C),
    "past the hook: children of a run whose parent is SIGKILLed": (C, C, C),
    "past the hook: a daemon (setsid) of a run killed at its wall-clock limit": (C, C, E),
    "past the hook: a daemon (setsid) of a run whose parent is SIGKILLed": (C, C, E),
}
# Contained only through the run's cgroup (memory over the whole tree; the members killed at the end where no PID
# namespace does it): where this machine gives no cgroup (not root, no delegated subtree) these escape in those modes.
NEEDS_CGROUP = {"past the hook: 4 processes x 200 MB against a 256 MB limit": ("isolated", "unisolated"),
                "past the hook: a daemon (double fork, setsid) outliving the run": ("unisolated",)}
# Contained without namespaces only by Landlock (the run's file system access; its disk quota is measured on the one
# directory Landlock lets it write): on a kernel without Landlock these escape in the unisolated mode.
NEEDS_LANDLOCK = {"past the hook: write a file in host /tmp", "past the hook: write a file in host /dev/shm (POSIX "
                  "shared memory)", "dir_fd climb: write in host /tmp", "dir_fd climb: write in host /dev/shm",
                  "sqlite ATTACH DATABASE in host /tmp", "sqlite VACUUM INTO host /tmp",
                  "readline.write_history_file in host /tmp", "_posixshmem.shm_open (host /dev/shm)",
                  "a fresh posix module (_imp.create_builtin): mkfifo in host /tmp",
                  "find a secret on a host command line (/proc/*/cmdline)", "read a file of the repository (README.md)",
                  "write 128 MiB with a disk quota of 32 MiB"}
NEEDS_CGROUP["write 192 MiB into files deleted while held open (quota 32 MiB, memory 96 MB)"] = ("unisolated",)


def expected(attack: str, mode: str) -> str:
    if mode in NEEDS_CGROUP.get(attack, ()) and isolation_for(mode).cgroup is None:
        return E
    if mode == "unisolated" and attack in NEEDS_LANDLOCK and not isolation_for(mode).landlock:
        return E
    return EXPECTED[attack][MODES.index(mode)]


# Prepended to programs that get past the audit hook first. They run without the hook (sandbox._Run's
# audit_hook=False, tests only): it stands for any way around it (two that worked were a subinterpreter, whose audit
# hooks are its own, and _posixsubprocess loaded under another name; the hook now refuses both, which the rows "the
# hook refuses ..." check), because the hook is defence in depth and the question is what the kernel contains.
PAST_HOOK = r"""
import os, subprocess, sys


def past_hook(source, **values):
    '''Run `source` (with `values` bound) in a fresh interpreter: with no audit hook in place nothing refuses it.'''
    source = "".join(f"{k} = {v!r}\n" for k, v in values.items()) + "print('past the hook', flush=True)\n" + source
    python = next(p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK))
    subprocess.run([python, "-I", "-S", "-c", source])

"""


class NoVehicle(Exception):
    """The program did not get past the hook (neither way worked): its rows cannot be judged."""


def past_hook(source: str, **values) -> str:
    """A program that runs `source` past the audit hook (see PAST_HOOK)."""
    args = "".join(f", {k}={v!r}" for k, v in values.items())
    return PAST_HOOK + f"past_hook({source!r}{args})\n"


def run_past_hook(source: str, limits: SandboxLimits | None = None, **values):
    result = run(past_hook(source, **values), limits or LIMITS, audit_hook=False)
    if "past the hook\n" not in result.stdout:
        raise NoVehicle(f"{result.status}: {result.message}: {result.stderr[-400:]}")
    return result


def token() -> str:
    return f"pyrl-attack-{os.getpid()}-{secrets.token_hex(4)}"


def run(code: str, limits: SandboxLimits = LIMITS, audit_hook: bool = True, stdin: str = ""):
    """run_code as a caller that opted into unisolated runs; audit_hook=False: code past the hook (PAST_HOOK)."""
    return sandbox._Run(code, "python", stdin, limits, None, True, audit_hook=audit_hook).execute()


def verdict(escaped: bool, evidence) -> tuple[str, str]:
    return (E if escaped else C), str(evidence)[:600]


def kill_marked(marker: str) -> list[int]:
    """SIGKILL this process's descendants carrying `marker` (what escaped a run); -> their pids."""
    found = processes(marker)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


def sleepers(mark: str) -> list[int]:
    """The run's children started as `os.execv("/bin/sleep", [mark, ...])`."""
    found = []
    for pid in processes(mark):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(mark.encode() + b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def watching(look, function, *args, **kwargs):
    """function(*args, **kwargs) in a thread while look() is polled: -> (its value, every pid it found)."""
    out, seen = {}, set()
    thread = threading.Thread(target=lambda: out.setdefault("value", function(*args, **kwargs)))
    thread.start()
    while thread.is_alive():
        seen.update(look())
        time.sleep(0.02)
    thread.join()
    if "value" not in out:
        raise RuntimeError("the run raised (see the thread's traceback above)")
    return out["value"], seen


def remove(path: str) -> bool:
    """Remove a marker file; -> whether it was there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def bystander(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(list(argv) or ["sleep", "30"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


# ---- the groups of attacks: each runs one program (or a few) in a mode and judges several rows ----
GROUPS = {}


def group(*rows):
    def register(function):
        for row in rows:
            GROUPS[row] = function
        return function
    return register


MARKERS = ("past the hook: write a file in host /tmp",
           "past the hook: write a file in host /dev/shm (POSIX shared memory)",
           "past the hook: write a file in the repository", "past the hook: write a file in the home directory")


@group(*MARKERS, "past the hook: SysV message queue", "past the hook: a daemon (double fork, setsid) outliving the run")
def files_ipc_daemon(mode):
    mark = token()
    places = ("/tmp", "/dev/shm", REPO, HOME)
    key = int.from_bytes(secrets.token_bytes(3), "little") + 1
    source = r'''
import ctypes, os, time
for place in places:
    os.system(f"echo {mark} > {place}/{mark} 2>/dev/null")
print("msgget", ctypes.CDLL(None).msgget(key, 0o1000 | 0o600), flush=True)  # IPC_CREAT
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv("/bin/sleep", [mark, "20"])  # the mark on its command line
    os._exit(0)
os.wait()
time.sleep(0.5)  # for the test to see the daemon start
'''
    before = ipc_objects()
    result, seen = watching(lambda: sleepers(mark), run_past_hook, source, places=places, mark=mark, key=key)
    time.sleep(0.3)
    daemons = kill_marked(mark)
    observed = {row: verdict(remove(os.path.join(place, mark)), result) for row, place in zip(MARKERS, places)}
    queues = [entry for entry in ipc_objects() - before if entry[0] == "msg" and entry[1].split("/")[0] == str(key)]
    for _, entry in queues:
        ctypes.CDLL(None).msgctl(int(entry.split("/")[1]), 0, None)  # IPC_RMID
    observed["past the hook: SysV message queue"] = verdict(bool(queues), (queues, result.stdout))
    observed["past the hook: a daemon (double fork, setsid) outliving the run"] = (
        ("unclear", "the daemon was never seen running") if not seen else verdict(bool(daemons), daemons))
    return observed


@group("past the hook: 4 processes x 200 MB against a 256 MB limit")
def memory(mode):
    source = r'''
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        held, touched = [], 0
        try:
            while touched < 200:
                held.append(b"\x01" * (10 << 20))  # written, so resident
                touched += 10
                os.write(1, b"+")
        except MemoryError:
            pass
        time.sleep(0.6)  # all four hold theirs at once
        os.write(1, f"\nheld {touched}\n".encode())
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
'''
    result = run_past_hook(source)
    held = sum(int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("held "))
    touched = 10 * result.stdout.count("+")  # over time: proof that the children did allocate
    evidence = f"{held} MB held at once, {touched} MB touched in all; {result.status}: {result.message}"
    return {"past the hook: 4 processes x 200 MB against a 256 MB limit":
            ("unclear", evidence) if touched < 200 else verdict(held >= LIMITS.memory_mb, evidence)}


@group("past the hook: connect to a world-writable unix socket in host /tmp",
       "past the hook: connect to an abstract unix socket of the host", "past the hook: TCP to a listener on 127.0.0.1",
       "past the hook: UDP to a socket on 127.0.0.1")
def network(mode):
    mark = token()
    path = os.path.join("/tmp", mark + ".sock")
    listeners = {}
    for name, family, kind, address in (("unix", socket.AF_UNIX, socket.SOCK_STREAM, path),
                                        ("abstract", socket.AF_UNIX, socket.SOCK_STREAM, "\0" + mark),
                                        ("tcp", socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
                                        ("udp", socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))):
        s = socket.socket(family, kind)
        s.bind(address)
        if kind == socket.SOCK_STREAM:
            s.listen(8)
        s.setblocking(False)
        listeners[name] = s
    os.chmod(path, 0o777)
    source = r'''
import socket
for family, kind, address in targets:
    try:
        s = socket.socket(family, kind)
        s.settimeout(1)
        if kind == socket.SOCK_DGRAM:
            s.sendto(mark.encode(), tuple(address))
        else:
            s.connect(address if isinstance(address, str) else tuple(address))
            s.sendall(mark.encode())
        s.close()
        print("sent", address, flush=True)
    except OSError as e:
        print("refused", address, e, flush=True)
'''
    unix, inet = int(socket.AF_UNIX), int(socket.AF_INET)
    stream, dgram = int(socket.SOCK_STREAM), int(socket.SOCK_DGRAM)
    targets = [(unix, stream, path), (unix, stream, "\0" + mark), (inet, stream, listeners["tcp"].getsockname()),
               (inet, dgram, listeners["udp"].getsockname())]
    try:
        result = run_past_hook(source, targets=targets, mark=mark)
        reached = {}
        for name, s in listeners.items():
            data = b""
            try:
                if name == "udp":
                    data = s.recvfrom(4096)[0]
                else:
                    conn, _ = s.accept()
                    conn.settimeout(1)
                    data = conn.recv(4096)
                    conn.close()
            except OSError:
                pass
            reached[name] = mark.encode() in data
    finally:
        for s in listeners.values():
            s.close()
        remove(path)
    rows = ("past the hook: connect to a world-writable unix socket in host /tmp",
            "past the hook: connect to an abstract unix socket of the host",
            "past the hook: TCP to a listener on 127.0.0.1", "past the hook: UDP to a socket on 127.0.0.1")
    return {row: verdict(reached[name], result.stdout) for row, name in zip(rows, ("unix", "abstract", "tcp", "udp"))}


CLIMB = ("dir_fd climb: write in host /tmp", "dir_fd climb: write in host /dev/shm",
         "dir_fd climb: write in the repository", "dir_fd climb: write in the home directory")


@group(*CLIMB)
def dir_fd_climb(mode):
    """A descriptor of the work directory, then the working directory moved n levels down (n: the work directory's
    depth): "../" * n + target, which the hook resolves from the working directory (inside), the kernel from the
    descriptor (the root)."""
    mark = token()
    places = ("/tmp", "/dev/shm", REPO, HOME)
    source = r'''
import os
depth = os.getcwd().count("/")
top = os.open(".", os.O_RDONLY)
os.makedirs("/".join(["d"] * depth))
os.chdir("/".join(["d"] * depth))
for place in places:
    try:
        fd = os.open("../" * depth + place.lstrip("/") + "/" + mark, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=top)
        os.write(fd, mark.encode())
        os.close(fd)
        print("written", place)
    except OSError as e:
        print("refused", place, e)
'''
    result = run(f"places = {places!r}\nmark = {mark!r}\n" + source)
    return {row: verdict(remove(os.path.join(place, mark)), result.stdout or result.message)
            for row, place in zip(CLIMB, places)}


C_WRITERS = ("sqlite ATTACH DATABASE in host /tmp", "sqlite VACUUM INTO host /tmp",
             "readline.write_history_file in host /tmp", "_posixshmem.shm_open (host /dev/shm)",
             "a fresh posix module (_imp.create_builtin): mkfifo in host /tmp",
             "a fresh posix module: mknod of /dev/kmsg (1, 11), then writing to the host's kernel log")


@group(*C_WRITERS)
def c_writers(mode):
    mark = token()
    paths = [f"/tmp/{mark}-attach", f"/tmp/{mark}-vacuum", f"/tmp/{mark}-readline", f"/dev/shm/{mark}-shm",
             f"/tmp/{mark}-fifo"]
    try:  # the host's kernel log, read from its end: a line the run writes there is the evidence
        kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(kmsg, 0, os.SEEK_END)
    except OSError:
        kmsg = None
    source = r'''
import os, stat
def attempt(name, step):
    try:
        step()
        print(name, "done", flush=True)
    except Exception as e:
        print(name, "refused", type(e).__name__, e, flush=True)
def attach():
    import sqlite3
    db = sqlite3.connect(":memory:")
    db.execute(f"ATTACH DATABASE '{paths[0]}' AS x")
    db.execute("CREATE TABLE x.t (a)")
    db.commit()
def vacuum():
    import sqlite3
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (a)")
    db.execute(f"VACUUM INTO '{paths[1]}'")
def history():
    import readline
    readline.add_history(mark)
    readline.write_history_file(paths[2])
def shm():
    import _posixshmem
    os.write(_posixshmem.shm_open("/" + os.path.basename(paths[3]), os.O_CREAT | os.O_RDWR, 0o600), mark.encode())
def fresh_posix():
    import _imp, importlib.machinery
    return _imp.create_builtin(importlib.machinery.ModuleSpec("posix", importlib.machinery.BuiltinImporter))
def fifo():
    fresh_posix().mkfifo(paths[4])
def kmsg():
    fresh_posix().mknod("kmsg", stat.S_IFCHR | 0o600, os.makedev(1, 11))
    with open("kmsg", "w") as f:
        f.write(mark + "\n")
for name, step in (("attach", attach), ("vacuum", vacuum), ("readline", history), ("shm", shm), ("fifo", fifo),
                   ("kmsg", kmsg)):
    attempt(name, step)
'''
    try:
        result = run(f"paths = {paths!r}\nmark = {mark!r}\n" + source)
        logged = []
        while kmsg is not None:
            try:
                logged.append(os.read(kmsg, 8192))
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten meanwhile
                continue
    finally:
        if kmsg is not None:
            os.close(kmsg)
    found = [remove(path) for path in paths]
    observed = {row: verdict(hit, result.stdout or result.message) for row, hit in zip(C_WRITERS, found)}
    observed[C_WRITERS[-1]] = (("n/a", "this process cannot read /dev/kmsg") if kmsg is None else
                               verdict(any(mark.encode() in line for line in logged), result.stdout))
    return observed


READS = ("read /etc/shadow", "read a bystander's /proc/<pid>/environ",
         "find a secret on a host command line (/proc/*/cmdline)", "read a file of the repository (README.md)",
         "read a file in the home directory")


@group(*READS)
def reads(mode):
    mark = token()
    environ_secret, cmdline_secret, home_secret = (f"{mark}-{what}-{secrets.token_hex(8)}" for what in
                                                   ("environ", "cmdline", "home"))
    try:
        with open("/etc/shadow") as f:
            shadow = f.readline().strip() or None
    except OSError:  # not root: nothing to steal that this process could check
        shadow = None
    with open(os.path.join(REPO, "README.md")) as f:
        readme = max(f.read(2048).splitlines(), key=len)
    home_file = os.path.join(HOME, f".{mark}")
    try:
        with open(home_file, "w") as f:
            f.write(home_secret)
        os.chmod(home_file, 0o644)
    except OSError:  # no home directory of its own (nobody): nothing to steal there
        home_secret = None
    by_env = bystander(env={"PYRL_SECRET": environ_secret, "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    by_cmdline = bystander("sh", "-c", "sleep 30", "sh", cmdline_secret)
    source = r'''
import os
def show(path, size=4096):
    try:
        with open(path, "rb") as f:
            print(path, f.read(size).replace(b"\0", b" ").decode("utf-8", "replace"))
    except OSError as e:
        print(path, "refused", e)
show("/etc/shadow")
show(f"/proc/{pid}/environ")
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            line = f.read().replace(b"\0", b" ").decode()
        if prefix in line:
            print("cmdline", line)
    except OSError:
        pass
show(readme)
try:
    for name in os.listdir(home):
        if name.startswith("." + prefix):
            show(os.path.join(home, name))
except OSError as e:
    print(home, "refused", e)
'''
    try:
        values = {"pid": by_env.pid, "prefix": "pyrl-attack-", "readme": os.path.join(REPO, "README.md"), "home": HOME}
        result = run("".join(f"{k} = {v!r}\n" for k, v in values.items()) + source)
    finally:
        stop(by_env, by_cmdline)
        remove(home_file)
    out = result.stdout
    return {row: ("n/a", "no such file this process can read or write") if secret is None else
            verdict(secret in out, out or result.message)
            for row, secret in zip(READS, (shadow, environ_secret, cmdline_secret, readme, home_secret))}


SIGNALS = ("kill a bystander (os.kill, the hook in the way)", "past the hook: kill a bystander (os.kill)",
           "past the hook: kill a bystander (pidfd_open + pidfd_send_signal)")


@group(*SIGNALS)
def signals(mode):
    plain, killed, pidfd = bystander(), bystander(), bystander()
    source = r'''
import ctypes, os
try:
    os.kill(killed, 9)
    print("kill sent", flush=True)
except OSError as e:
    print("kill refused", e, flush=True)
libc = ctypes.CDLL(None, use_errno=True)
try:
    number = ctypes.CDLL("libseccomp.so.2").seccomp_syscall_resolve_name
    number.argtypes = [ctypes.c_char_p]
    open_nr, send_nr = number(b"pidfd_open"), number(b"pidfd_send_signal")
except OSError:
    open_nr, send_nr = 434, 424  # the same on every architecture
fd = libc.syscall(open_nr, pidfd, 0)
if fd < 0:
    print("pidfd_open refused", os.strerror(ctypes.get_errno()), flush=True)
elif libc.syscall(send_nr, fd, 9, None, 0) < 0:
    print("pidfd_send_signal refused", os.strerror(ctypes.get_errno()), flush=True)
else:
    print("pidfd signal sent", flush=True)
'''
    try:
        hooked = run(f"import os\nos.kill({plain.pid}, 9)\n")
        result = run_past_hook(source, killed=killed.pid, pidfd=pidfd.pid)
        time.sleep(0.1)
        dead = [proc.poll() is not None for proc in (plain, killed, pidfd)]
    finally:
        stop(plain, killed, pidfd)
    return {SIGNALS[0]: verdict(dead[0], hooked.message), SIGNALS[1]: verdict(dead[1], result.stdout),
            SIGNALS[2]: verdict(dead[2], result.stdout)}


@group("forge the status report on inherited descriptors 3..63",
       "past the hook: forge the status report through /proc/<supervisor>/fd")
def forged_report(mode):
    """The result must say what really happened (exit code 3), and run_code must not raise."""
    observed = {}
    inherited = ("import os, sys\nfor fd in range(3, 64):\n    for text in (b'exit 0', b'setup forged'):\n"
                 "        try:\n            os.write(fd, text)\n        except OSError:\n            pass\n"
                 "sys.exit(3)\n")
    source = r'''
import os
try:
    with open(f"/proc/{supervisor}/cmdline", "rb") as f:
        status_fd = int(f.read().split(b"\0")[-3])
    with open(f"/proc/{supervisor}/fd/{status_fd}", "w") as f:
        f.write("exit 0")
    print("forged", flush=True)
except (OSError, ValueError) as e:
    print("refused", e, flush=True)
'''
    through_proc = PAST_HOOK + f"past_hook({source!r}, supervisor=os.getppid())\nsys.exit(3)\n"
    for row, code in (("forge the status report on inherited descriptors 3..63", inherited),
                      ("past the hook: forge the status report through /proc/<supervisor>/fd", through_proc)):
        try:
            result = run(code, audit_hook=code is not through_proc)
        except Exception as e:  # noqa: BLE001 - a forged report must never make run_code raise
            observed[row] = verdict(True, f"run_code raised {type(e).__name__}: {e}")
            continue
        if code is through_proc and "past the hook\n" not in result.stdout:
            raise NoVehicle(f"{result.status}: {result.message}: {result.stderr[-400:]}")
        observed[row] = verdict(result.returncode != 3 or result.status != "error", result)
    return observed


@group("a run finds or changes the files of a run going on at the same time")
def concurrent_runs(mode):
    """Run A writes a secret in its directory, /tmp and /dev/shm and waits; run B, past the hook, looks for it in
    /tmp, /dev/shm, /proc/*/cwd and /proc/*/root, and other runs' host directories, and writes into what it finds."""
    mark = token()
    first = r'''
import os, time
paths = [f"secret-{mark}", f"/tmp/secret-{mark}", f"/dev/shm/secret-{mark}"]
for path in paths:
    try:
        with open(path, "w") as f:
            f.write(mark)
    except OSError:
        pass
time.sleep(2)
for path in paths:
    try:
        with open(path) as f:
            print(path, f.read())
    except OSError:
        pass
'''
    second = r'''
import os, time
def candidates():
    roots = ["/tmp", "/dev/shm", "/sandbox", "/", os.path.dirname(os.getcwd())]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        roots += [f"/proc/{pid}/cwd", f"/proc/{pid}/root/sandbox", f"/proc/{pid}/root/tmp", f"/proc/{pid}/root/dev/shm"]
    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix):
                yield os.path.join(root, name)
            elif name.startswith("pyrl-sandbox-"):
                try:
                    yield from (os.path.join(root, name, n) for n in os.listdir(os.path.join(root, name))
                                if n.startswith(prefix))
                except OSError:
                    pass
deadline = time.monotonic() + 1
found = set()
while time.monotonic() < deadline and not found:
    for path in candidates():
        try:
            with open(path) as f:
                print("found", path, f.read(), flush=True)
            found.add(path)
        except OSError as e:
            print("unreadable", path, e, flush=True)
        try:
            with open(path, "a") as f:
                f.write(" B-was-here")
        except OSError:
            pass
    time.sleep(0.05)
'''
    results = {}
    a = threading.Thread(target=lambda: results.setdefault("a", run(f"mark = {mark!r}\n" + first)))
    a.start()
    deadline = time.monotonic() + 10  # until A has written its secret (seen from here, in its working directory)
    while time.monotonic() < deadline and a.is_alive() and not any(
            os.path.exists(f"/proc/{pid}/cwd/secret-{mark}") for pid in processes()):
        time.sleep(0.02)
    results["b"] = run_past_hook(second, prefix="secret-pyrl-attack-")
    a.join()
    a_out, b_out = results["a"].stdout, results["b"].stdout
    return {"a run finds or changes the files of a run going on at the same time":
            verdict(mark in b_out or "B-was-here" in a_out, f"A: {a_out!r} B: {b_out!r}")}


@group("write 128 MiB with a disk quota of 32 MiB")
def disk(mode):
    quota = 32 << 20
    source = r'''
import os
block = b"\0" * (1 << 20)
places = []
for place in (".", "/tmp", "/dev/shm"):
    try:
        os.close(os.open(place + "/probe", os.O_CREAT | os.O_WRONLY))
        places.append(place)
    except OSError:
        pass
written, n = 0, 0
try:
    while written < 128 << 20 and places:
        fd = os.open(f"{places[n % len(places)]}/fill-{n}", os.O_CREAT | os.O_WRONLY)
        n += 1
        for _ in range(8):
            done = os.write(fd, block)
            written += done
            os.write(1, b"+" * (done >> 20))
            if done < len(block):
                raise OSError("short write")
        os.close(fd)
except OSError as e:
    print("\nstopped:", e)
'''
    result = run(source, limits=SandboxLimits(wall_s=20, cpu_s=10, memory_mb=256, max_disk_bytes=quota,
                                              max_file_bytes=16 << 20))
    mib = result.stdout.count("+")
    evidence = f"{mib} MiB written: {result.stdout[-200:]!r} {result.message}"
    # isolated: the tmpfs refuses the first byte past the quota. Without a mount namespace the supervisor measures
    # the run's directory every DISK_POLL_S and kills the run once it is over: bounded by what 5 ms of writing adds
    # (measured on this machine: 3-25 MiB at page-cache speed), so "contained" there is: stopped for its quota
    # before twice the quota
    allowed = (quota >> 20) + 1 if mode == "isolated" else 2 * (quota >> 20)
    stopped = mode == "isolated" or "disk quota" in result.message
    return {"write 128 MiB with a disk quota of 32 MiB":
            ("unclear", evidence) if mib < 16 else verdict(mib > allowed or not stopped, evidence)}


@group("write 192 MiB into files deleted while held open (quota 32 MiB, memory 96 MB)")
def deleted_files(mode):
    """Files unlinked while open are in no directory, so the unisolated mode's watchdog cannot see them: its
    directory is on a tmpfs (/dev/shm) whose pages the kernel charges to the run's memory cgroup."""
    source = r'''
import os
block = b"\0" * (1 << 20)
held = []
try:
    for n in range(12):
        fd = os.open(f"hidden-{n}", os.O_CREAT | os.O_RDWR)
        os.unlink(f"hidden-{n}")
        held.append(fd)
        for _ in range(16):
            if os.write(fd, block) < len(block):
                raise OSError("short write")
            os.write(1, b"+")
except OSError as e:
    print("\nstopped:", e)
'''
    result = run(source, limits=SandboxLimits(wall_s=20, cpu_s=10, memory_mb=96, max_disk_bytes=32 << 20,
                                              max_file_bytes=16 << 20))
    mib = result.stdout.count("+")
    evidence = f"{mib} MiB written: {result.stdout[-120:]!r} {result.status}: {result.message}"
    return {"write 192 MiB into files deleted while held open (quota 32 MiB, memory 96 MB)":
            ("unclear", evidence) if mib < 16 else verdict(mib > 96, evidence)}


SYSCALLS = {
    "past the hook: ptrace (attach to its own child)": "ptrace", "past the hook: unshare(CLONE_NEWUSER)": "unshare",
    "past the hook: clone(CLONE_NEWUSER)": "clone", "past the hook: mount": "mount", "past the hook: bpf": "bpf",
    "past the hook: keyctl": "keyctl", "past the hook: io_uring_setup": "io_uring_setup",
    "past the hook: perf_event_open": "perf_event_open", "past the hook: socket(AF_INET)": "AF_INET",
    "past the hook: socket(AF_NETLINK)": "AF_NETLINK", "past the hook: socket(AF_PACKET)": "AF_PACKET",
    "past the hook: io_setup (AIO contexts count against a host-wide limit)": "io_setup",
    "past the hook: listmount (Linux 6.8, newer than the libseccomp that builds the filter)": "listmount",
}
LISTMOUNT = 458  # the same number on every architecture


@group(*SYSCALLS)
def kernel_surface(mode):
    """Each call in a child of its own (one that works changes nothing of the run's); the child's exit code is the
    call's errno, 0 when it went through. Arguments are harmless: what matters is whether the kernel got to them
    (EFAULT, EINVAL, ENOENT, ENOKEY) or the call was refused (EPERM, EACCES, EAFNOSUPPORT, ENOSYS)."""
    source = r'''
import ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86_64 = {"ptrace": 101, "clone": 56, "unshare": 272, "bpf": 321, "keyctl": 250, "io_uring_setup": 425,
          "perf_event_open": 298, "io_setup": 206}
try:
    resolve = ctypes.CDLL("libseccomp.so.2").seccomp_syscall_resolve_name
    resolve.argtypes = [ctypes.c_char_p]
    number = lambda name: resolve(name.encode())
except OSError:
    number = X86_64.__getitem__
def call(name, *args):
    result = libc.syscall(ctypes.c_long(number(name) if isinstance(name, str) else name),
                          *(ctypes.c_long(a) for a in args))
    if result < 0:
        return ctypes.get_errno()
    if name == "clone":
        if result == 0:  # the clone
            os._exit(0)
        os.waitpid(result, 0)
    return 0
def ptrace():
    child = os.fork()
    if child == 0:
        time.sleep(5)
        os._exit(0)
    code = call("ptrace", 16, child, 0, 0)  # PTRACE_ATTACH
    os.kill(child, 9)
    return code
def mount():
    return 0 if libc.mount(b"none", b"/nonexistent-pyrl-attack", b"tmpfs", 0, None) == 0 else ctypes.get_errno()
def open_socket(family, kind):
    socket.socket(family, kind).close()
    return 0
trials = {
    "ptrace": ptrace,
    "unshare": lambda: call("unshare", 0x10000000),
    "clone": lambda: call("clone", 0x10000000 | 17, 0, 0, 0, 0),  # CLONE_NEWUSER | SIGCHLD
    "mount": mount,
    "bpf": lambda: call("bpf", 0, 0, 0),  # BPF_MAP_CREATE, no attributes
    "keyctl": lambda: call("keyctl", 0, -1, 0),  # KEYCTL_GET_KEYRING_ID of the thread keyring, not created
    "io_uring_setup": lambda: call("io_uring_setup", 1, 0),
    "perf_event_open": lambda: call("perf_event_open", 0, 0, -1, -1, 0),
    "io_setup": lambda: call("io_setup", 1, 0),  # no context pointer: EFAULT if the kernel gets to it
    "listmount": lambda: call(listmount, 0, 0, 0, 0),  # no request: EFAULT if the kernel gets to it
    "AF_INET": lambda: open_socket(socket.AF_INET, socket.SOCK_STREAM),
    "AF_NETLINK": lambda: open_socket(socket.AF_NETLINK, socket.SOCK_RAW),
    "AF_PACKET": lambda: open_socket(socket.AF_PACKET, socket.SOCK_RAW),
}
for name, trial in trials.items():
    pid = os.fork()
    if pid == 0:
        try:
            code = trial()
        except OSError as e:
            code = e.errno or 254
        except BaseException:
            code = 253
        os._exit(code & 255)
    _, status = os.waitpid(pid, 0)
    print("trial", name, os.waitstatus_to_exitcode(status), flush=True)
'''
    result = run_past_hook(source, listmount=LISTMOUNT)
    codes = {}
    for line in result.stdout.splitlines():
        if line.startswith("trial "):
            _, name, code = line.split()
            codes[name] = int(code)
    observed = {}
    for row, name in SYSCALLS.items():
        code = codes.get(name)
        evidence = f"{name}: " + ("no report: " + result.message + result.stderr[-300:] if code is None else
                                  "went through" if code == 0 else errno.errorcode.get(code, str(code)))
        observed[row] = ("unclear", evidence) if code is None else verdict(code not in REFUSED, evidence)
    if tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (6, 8):
        observed[LISTMOUNT_ROW] = ("n/a", "the kernel has no listmount (Linux < 6.8): nothing to refuse")
    return observed


LISTMOUNT_ROW = "past the hook: listmount (Linux 6.8, newer than the libseccomp that builds the filter)"


@group("the hook refuses a subinterpreter (whose audit hooks would be its own)",
       "the hook refuses _posixsubprocess loaded under another name")
def hook_vehicles(mode):
    """The two ways past the hook found while writing these tests, tried against the hook itself: each must be
    refused before any program starts (_xxsubinterpreters turns the hook's refusal into "interpreter creation
    failed")."""
    mark = token()
    subinterpreter = ("import _xxsubinterpreters as s\n"
                      f"s.run_string(s.create(), 'import os; os.system(\"/bin/sleep 5 {mark}\")')\n")
    renamed = ("import _imp, importlib.machinery, importlib.util, os, sys\n"
               "name = 'vehicle._posixsubprocess'\n"
               "path = next(os.path.join(d, f) for d in sys.path if os.path.isdir(d) for f in os.listdir(d)\n"
               "            if f.startswith('_posixsubprocess.'))\n"
               "spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, path))\n"
               "module = _imp.create_dynamic(spec)\n"
               "print('loaded', flush=True)\n")
    observed = {}
    for row, code in (("the hook refuses a subinterpreter (whose audit hooks would be its own)", subinterpreter),
                      ("the hook refuses _posixsubprocess loaded under another name", renamed)):
        result = run(code)
        started = sleepers(mark)
        kill_marked(mark)
        observed[row] = verdict(result.ok or "loaded" in result.stdout or bool(started),
                                (result.status, result.message, started))
    return observed


@group("leftovers after a normal run")
def normal_run(mode):
    before = ipc_objects()
    result = run("import threading, os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
                 "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n")
    left = leftovers(within_s=2)
    changed = ipc_objects() ^ before
    return {"leftovers after a normal run": verdict(bool(left or changed or not result.ok), (left, changed, result))}


CHILDREN = r'''
import os, time
for _ in range(2):
    if os.fork() == 0:
        if detach:  # a daemon: out of the run's process group and session
            os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv("/bin/sleep", [mark, "30"])  # the mark on its command line
time.sleep(30)
'''


@group("past the hook: children of a run killed at its wall-clock limit",
       "past the hook: a daemon (setsid) of a run killed at its wall-clock limit")
def timed_out(mode):
    observed = {}
    for row, detach in (("past the hook: children of a run killed at its wall-clock limit", False),
                        ("past the hook: a daemon (setsid) of a run killed at its wall-clock limit", True)):
        mark = token()
        result, seen = watching(lambda: sleepers(mark), run_past_hook, CHILDREN,
                                SandboxLimits(wall_s=2, cpu_s=5, memory_mb=256), mark=mark, detach=detach)
        left = leftovers(mark, within_s=2)
        kill_marked(mark)
        evidence = f"children seen {sorted(seen)}, left {left}, {result.status}"
        observed[row] = ("unclear", evidence) if len(seen) < 2 else verdict(bool(left) or result.status != "timeout",
                                                                             evidence)
    return observed


PARENT = r'''
import sys
sys.path.insert(0, sys.argv[2])
from sandbox_leftovers import using
import pyrl.sandbox as sandbox
with using(sys.argv[1]):
    print(sandbox._Run(sys.stdin.read(), "python", "", sandbox.SandboxLimits(wall_s=30, cpu_s=10), None, True,
                       audit_hook=False).execute())
'''


@group("past the hook: children of a run whose parent is SIGKILLed",
       "past the hook: a daemon (setsid) of a run whose parent is SIGKILLed")
def parent_killed(mode):
    return {"past the hook: children of a run whose parent is SIGKILLed": parent_killed_with(mode, False),
            "past the hook: a daemon (setsid) of a run whose parent is SIGKILLed": parent_killed_with(mode, True)}


def parent_killed_with(mode, detach):
    """A separate process runs the program (children sleeping past the hook; `detach`: each in a session of its
    own); once they are seen it is SIGKILLed. Within 5 s no process of the run may be left (the supervisor notices
    its parent's end on a pipe), nor its host directory (the supervisor removes it); the next probe removes the
    run's cgroups."""
    mark = token()
    before = ipc_objects()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode, os.path.dirname(os.path.abspath(__file__))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parent.stdin.write(past_hook(CHILDREN, mark=mark, detach=detach))
    parent.stdin.close()
    deadline = time.monotonic() + 15
    while len(sleepers(mark)) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.05)
    started = sleepers(mark)
    parent.kill()
    parent.wait()
    output = parent.stdout.read()
    parent.stdout.close()
    left = leftovers(mark, within_s=5).get("processes", [])
    kill_marked(mark)
    orphaned = directories(parent.pid) + cgroups(parent.pid)
    directories_left = directories(parent.pid)
    sandbox._remove_stale_directories()  # what the next process's probe does
    cgroup.probe()
    stale = directories(parent.pid) + cgroups(parent.pid)
    changed = ipc_objects() ^ before
    evidence = (f"children seen {started}; left {left}; host directories left {directories_left}; "
                f"{len(orphaned)} directories and cgroups before the next "
                f"probe, after it {stale}; ipc {changed}" +
                ("" if len(started) >= 2 else f"; the parent's output: {output[-400:]}"))
    return ("unclear", evidence) if len(started) < 2 else verdict(bool(left or directories_left or stale or changed),
                                                                  evidence)


assert set(GROUPS) == set(EXPECTED), set(GROUPS) ^ set(EXPECTED)
_observed: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}


def observe(attack: str, mode: str) -> tuple[str, str]:
    """(outcome, evidence) of `attack` in `mode`, its group run once per mode."""
    function = GROUPS[attack]
    key = (function.__name__, mode)
    if key not in _observed:
        with using(mode):
            try:
                _observed[key] = function(mode)
            except NoVehicle as e:
                _observed[key] = {row: ("unclear", f"did not get past the hook: {e}")
                                  for row, f in GROUPS.items() if f is function}
    return _observed[key][attack]


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    adopt_orphans(True)
    yield
    adopt_orphans(False)


def skipped(mode: str) -> str | None:
    """Why `mode`'s column is not checked here, or None."""
    if unavailable(mode):
        return unavailable(mode)
    if mode != "isolated" and os.geteuid() != 0:
        return "EXPECTED's verdicts for the modes without a kernel boundary are those of a run as root"
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", list(EXPECTED))
def test_attack(attack, mode):
    reason = skipped(mode)
    if reason:
        pytest.skip(reason)
    outcome, evidence = observe(attack, mode)
    if outcome == "n/a":
        pytest.skip(evidence)
    want = expected(attack, mode)
    assert outcome == want, f"{attack!r} in mode {mode}: expected {want}, observed {outcome}: {evidence}"
    assert leftovers() == {}, "a sandboxed process, directory or cgroup outlived its run"


def main() -> int:
    """Print the observed table as markdown (a cell that differs from EXPECTED in bold; -v: its evidence too);
    exit 1 on any difference."""
    adopt_orphans(True)
    modes = [mode for mode in MODES if not skipped(mode)]
    table = {mode: {attack: observe(attack, mode) for attack in EXPECTED} for mode in modes}
    differences = []
    print("| attack | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for attack in EXPECTED:
        cells = []
        for mode in MODES:
            outcome, evidence = table[mode][attack] if mode in table else ("n/a", "")
            want = expected(attack, mode)
            if outcome in (want, "n/a"):
                cells.append(outcome)
            else:
                cells.append(f"**{outcome}** (expected {want})")
                differences.append(f"{attack} [{mode}]: {evidence}")
        print(f"| {attack} | " + " | ".join(cells) + " |")
    for mode in MODES:
        if mode not in table:
            print(f"\n{mode}: not run: {skipped(mode)}")
    if "-v" in sys.argv:
        for line in differences:
            print("\n" + line)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
