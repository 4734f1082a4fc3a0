"""The sandboxed side of pyrl.sandbox: run as a script by the isolated interpreter (`python -I -S -B`), never
imported.

A supervisor (this process: in a PID namespace, its init) forks the worker and reports how it ended. The worker
reads the code, drops to the run's own uid when told to, lowers its resource limits, installs the audit hook and
runs the code as `__main__`. What the worker needs is imported before the hook (whose checks would apply to it).
Standard library only: the interpreter runs without site-packages.
"""

import builtins
import json
import linecache
import os
import resource
import sys
import traceback
import types

BLOCK_PREFIX = "pyrl.sandbox: "  # the parent recognises a blocked operation by this prefix in the last stderr line

# events refused outright: starting programs, network access, and ways to reach the hook's state or lift limits
DENIED = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "resource.setrlimit", "resource.prlimit", "sqlite3.enable_load_extension",
    "sqlite3.load_extension",
})
# event -> ((index of a path argument, index of its dir_fd argument or None), ...) for events that change the file
# system: allowed only inside the sandbox directory
WRITES = {
    "os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.link": ((0, 2), (1, 3)), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.chflags": ((0, None),), "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),), "sqlite3.connect": ((0, None),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
DEVICES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})  # harmless places to write outside
AF_UNIX = 1  # socket.AF_UNIX: local socket pairs (asyncio's self-pipe) stay usable; socket.connect/bind do not


def make_hook(work: str):
    """The audit hook confining the code to `work`. Every function, table and constant it uses is bound here (the
    tables as read-only copies), so code that later replaces os.*, builtins or this script's globals (reachable
    through frames) cannot change what it checks; nothing outside this closure refers to the hook."""
    lstat, stat, readlink, getcwd = os.lstat, os.stat, os.readlink, os.getcwd
    fspath, any_, isinstance_, str_, bytes_, int_ = os.fspath, any, isinstance, str, bytes, int
    denied, writes, write_flags, devices = DENIED, types.MappingProxyType(dict(WRITES)), WRITE_FLAGS, DEVICES
    block_prefix, af_unix, permission_error = BLOCK_PREFIX, AF_UNIX, PermissionError
    own_pid, own_group = os.getpid(), os.getpgid(0)
    prefix = work + "/"

    def deny(what):
        raise permission_error(f"{block_prefix}{what} is not allowed")

    def resolve(path):
        """The absolute path with every symbolic link resolved (missing components taken as written)."""
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        done, todo, hops = "", path.split("/")[::-1], 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                done = done[:done.rfind("/")]
                continue
            candidate = done + "/" + name
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                done = candidate
                continue
            if mode & 0o170000 == 0o120000:  # a symbolic link
                hops += 1
                if hops > 40:
                    return None
                target = readlink(candidate)
                if target.startswith("/"):
                    done = ""
                todo.extend(target.split("/")[::-1])
            else:
                done = candidate
        return done or "/"

    def as_text(path):
        path = fspath(path)
        return path.decode("utf-8", "surrogateescape") if isinstance_(path, bytes_) else path

    def inside(path, dir_fd=None):
        """Whether `path` (or the file that descriptor `path` refers to) lies inside the sandbox directory."""
        if isinstance_(path, int_):
            path, dir_fd = readlink(f"/proc/self/fd/{path}"), None
        path = as_text(path)
        if dir_fd is not None and dir_fd >= 0 and not path.startswith("/"):
            path = readlink(f"/proc/self/fd/{dir_fd}") + "/" + path
        real = resolve(path)
        return real is not None and (real == work or real.startswith(prefix))

    def hook(event, args):
        if event in denied or event.startswith("ctypes."):
            deny(event)
        elif event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int_):  # a descriptor already open
                return
            writing = (isinstance_(flags, int_) and flags & write_flags) or (
                isinstance_(mode, str_) and any_(c in mode for c in "wax+"))
            if writing and as_text(path) in devices:
                return
            if not inside(path):
                if writing:
                    deny(f"writing {as_text(path)!r} (outside the sandbox directory)")
                try:
                    is_dir = stat(path).st_mode & 0o170000 == 0o040000
                except OSError:
                    return
                if is_dir:  # a directory descriptor would let dir_fd= calls write outside
                    deny(f"opening directory {as_text(path)!r} (outside the sandbox directory)")
        elif event in writes:
            for path_index, fd_index in writes[event]:
                path = args[path_index]
                if event == "sqlite3.connect" and as_text(path) == ":memory:":
                    continue
                if not inside(path, None if fd_index is None else args[fd_index]):
                    deny(f"{event} on {path!r} (outside the sandbox directory)")
        elif event.startswith("socket."):
            if event != "socket.__new__" or args[1] != af_unix:
                deny(f"{event} (no network in the sandbox)")
        elif event == "os.kill":
            if args[0] not in (0, own_pid, -own_group):
                deny("signalling other processes")
        elif event == "os.killpg":
            if args[0] != own_group:
                deny("signalling other process groups")
        elif event == "import" and args[0] in ("_posixsubprocess", "posix"):
            deny(f"importing {args[0]} afresh")
    return hook


def refuse_unaudited() -> None:
    """Calls that raise no audit event are replaced by refusals: _posixsubprocess.fork_exec (subprocess.Popen
    raises its event before forking, but fork_exec can be called directly), os.mknod and os.mkfifo (files made
    anywhere). Loading those modules afresh is refused by the hook's import rule."""
    import _posixsubprocess  # noqa: F401 - loaded so that the stub below takes its place in sys.modules
    import posix

    def refusal(name):
        def refuse(*args, **kwargs):
            raise PermissionError(f"{BLOCK_PREFIX}{name} is not allowed")
        return refuse

    stub = types.ModuleType("_posixsubprocess")
    stub.fork_exec = refusal("_posixsubprocess.fork_exec")
    sys.modules["_posixsubprocess"] = stub
    for name in ("mknod", "mkfifo"):
        setattr(posix, name, refusal(f"os.{name}"))
        setattr(os, name, getattr(posix, name))


def keep_imports_reachable() -> None:
    """Before the uid drop: the interpreter's directories may be unreadable to the new uid (a Python under
    /root), so they are opened now and imported from through /proc/self/fd, which needs no permission on the
    directories above them."""
    moved = {}
    for i, entry in enumerate(sys.path):
        try:
            fd = os.open(entry, os.O_PATH | os.O_DIRECTORY)
        except OSError:  # a missing entry (python311.zip) stays as it is
            continue
        moved[entry] = sys.path[i] = f"/proc/self/fd/{fd}"
    sys.path_importer_cache.clear()
    # packages imported already (encodings: codecs are imported on first use) find their submodules there too
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            for i, entry in enumerate(path):
                for old, new in moved.items():
                    if entry.startswith(old + "/"):
                        path[i] = new + entry[len(old):]


def run_worker(settings: dict) -> None:
    """Drop privileges, lower the limits, install the hook, run the code as __main__."""
    with open(settings["code"], encoding="utf-8") as f:
        source = f.read()
    work = os.path.realpath(settings["work"])
    uid = settings["uid"]
    if uid is not None:
        keep_imports_reachable()
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    for name, value in settings["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    refuse_unaudited()
    filename = "main.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # source lines in tracebacks
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module  # the code's globals, not this script's
    sys.argv = [filename]
    sys.path.insert(0, work)  # modules among the sandbox's files import as a script's neighbours do
    sys.addaudithook(make_hook(work))
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported as Python reports an uncaught exception
        traceback.print_exception(type(e), e, code_frames(e.__traceback__))
        sys.exit(1)


def code_frames(tb):
    """The traceback without this script's frames (the exec call, the hook's refusal): the code's own only."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    for frame, following in zip(kept, kept[1:] + [None]):
        frame.tb_next = following
    return kept[0] if kept else None


def main() -> None:
    """The supervisor: fork the worker, wait for it, report how it ended on the status descriptor ("exit N" or
    "signal N"; in a PID namespace unshare cannot pass a signal on), then exit, which in a PID namespace makes the
    kernel kill whatever the code left running."""
    settings = json.loads(sys.argv[1])
    status_fd = settings["status_fd"]
    worker = os.fork()
    if worker == 0:
        os.close(status_fd)  # the code cannot forge the report
        run_worker(settings)
        return
    _, status = os.waitpid(worker, 0)
    report = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    os.write(status_fd, report.encode())


if __name__ == "__main__":
    main()
