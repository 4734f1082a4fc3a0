"""The sandboxed side of pyrl.sandbox: run as a script by the isolated interpreter (`python -I -S -B`), never
imported.

The supervisor (this process) reads the run's settings, the code and its files from a descriptor, joins the run's
cgroups, and, when the parent asked for a kernel boundary (it runs under `unshare` in new mount, PID, network, IPC
and UTS namespaces, and is the PID namespace's init), builds the run's file system and pivots into it. It then
forks the worker and reports how the worker ended. The worker drops to the run's own uid (or, in a user namespace,
drops every capability), lowers its resource limits, restricts itself with Landlock, loads the seccomp filter,
installs the audit hook and runs the code as `__main__`. What the worker needs is imported before the filter and the
hook (whose checks would apply to it). Standard library only (ctypes for mount(2), pivot_root(2), capset(2) and
libseccomp): the interpreter runs without site-packages. Every run pays for this script's imports, so it imports little
(marshal, not json, for the settings; ctypes only where a namespace or the filter needs it; traceback on an error only).

The file system the code sees (namespace mode):
  /                a tmpfs, read-only once built; holds only what is listed here
  /usr /bin /lib*  the host's, read-only (merged-/usr symbolic links recreated as links)
  <stdlib dirs>    the interpreter's standard library directories, read-only, at their host paths
  /etc             passwd, group and hosts of the sandbox's own (no host file)
  /proc            a new proc of the run's PID namespace (absent where the kernel refuses one)
  /dev             null, zero, full, random, urandom (the host's devices, bound); fd, stdin, stdout, stderr links
  /sandbox /tmp /dev/shm   writable: directories of one tmpfs whose size is the run's disk quota
Nothing else of the host (no /root, /home, /work, /var, /sys, other runs) exists in it.
"""

import _signal
import builtins
import errno
import marshal
import os
import resource
import select
import sys
import types

SETUP_EXIT = 70  # pyrl.sandbox.SETUP_EXIT: setting up the run failed (the status descriptor says how)
BLOCK_PREFIX = "pyrl.sandbox: "  # the parent recognises a blocked operation by this prefix in the last stderr line
WORK, WRITABLE = "/sandbox", ("/sandbox", "/tmp", "/dev/shm")  # namespace mode's work dir and writable places
DEVICES = ("null", "zero", "full", "random", "urandom")
DISK_POLL_S = 0.005  # unisolated: how often the supervisor measures the run's directory against its disk quota

# events refused outright: starting programs, network access, and ways to reach the hook's state or lift limits
DENIED = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "resource.setrlimit", "resource.prlimit", "sqlite3.enable_load_extension",
    "sqlite3.load_extension",
    "cpython.PyInterpreterState_New",  # audit hooks are per interpreter: a subinterpreter would run unhooked
})
# event -> ((index of a path argument, index of its dir_fd argument or None), ...) for events that change the file
# system: allowed only inside the writable places
WRITES = {
    "os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.link": ((0, 2), (1, 3)), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.chflags": ((0, None),), "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),), "sqlite3.connect": ((0, None),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
SINKS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})  # harmless places to write outside
AF_UNIX = 1  # socket.AF_UNIX: local socket pairs (asyncio's self-pipe) stay usable; socket.connect/bind do not

# ---- system calls through libc ----
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_PDEATHSIG = 38, 24, 1
CAP_LAST = 63  # PR_CAPBSET_DROP past the kernel's last capability fails with EINVAL, which is ignored

_libc = None


def libc():
    """libc through ctypes, imported on first use (a run without namespaces or the filter does without)."""
    global _libc, ctypes
    if _libc is None:
        import ctypes  # lazy: the child imports little; ctypes only where a namespace or the filter needs it
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source, target, fstype=None, flags=0, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} on {target}")


def bind(source, target, writable=False, device=False):
    mount(source, target, None, MS_BIND | MS_REC)
    # nodev everywhere but on the device nodes bound one by one (a nodev mount makes opening them EACCES)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    try:
        mount(None, target, None, flags)
    except OSError:  # a user namespace may not clear nodev on a device bind: read-only, keeping its flags
        mount(None, target, None, MS_REMOUNT | MS_BIND | (0 if writable else MS_RDONLY))


# ---- seccomp, through libseccomp (the filter's BPF, architecture checks and x32 handling are its) ----
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
SCMP_FLTATR_CTL_OPTIMIZE = 8  # libseccomp >= 2.5; older ones ignore it (the filter is then a linear list)
NEWER_SYSCALLS = 128  # how many numbers past libseccomp's last known system call are refused (a decade of kernels)
# system calls code execution never needs: kernel, namespace, tracing and device interfaces (refused with EPERM)
REFUSED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "bpf", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "perf_event_open",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "quotactl_fd", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "open_by_handle_at",
    "name_to_handle_at", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "pidfd_open",
    "pidfd_send_signal", "pidfd_getfd", "fanotify_init", "lookup_dcookie", "iopl", "ioperm", "vhangup",
    "mount_setattr", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "sethostname",
    "setdomainname", "uselib", "nfsservctl", "kcmp", "process_madvise", "memfd_secret",
    # kernel AIO: its contexts count against a host-wide limit (fs.aio-max-nr) that one run could exhaust
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
)
# without a memory cgroup, memory these hold is charged to no rlimit: refused then (a tmpfs file, bounded by the
# disk quota, does what a memfd or a SysV segment would)
UNCOUNTED_MEMORY_SYSCALLS = ("memfd_create", "shmget", "msgget", "semget")
# without network and IPC namespaces, the host's SysV IPC objects and unix sockets (pathname or abstract) are the
# host's: refused then, every way an address can be named (socketpair and send/recv on its ends stay usable)
HOST_IPC_SYSCALLS = ("shmget", "msgget", "semget", "connect", "bind", "sendmsg", "sendmmsg")
S_IFMT, S_IFCHR, S_IFBLK = 0o170000, 0o020000, 0o060000
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
TIOCSTI = 0x5412


def load_seccomp(counted_memory: bool, host_ipc: bool) -> None:
    """Refuse REFUSED_SYSCALLS (UNCOUNTED_MEMORY_SYSCALLS unless a cgroup counts memory; HOST_IPC_SYSCALLS and
    sendto to an address when the run shares the host's network and IPC namespaces), device nodes (mknod of
    character/block devices), sockets other than AF_UNIX, clone into new namespaces, clone3 (its flags cannot be
    inspected: ENOSYS makes libc fall back to clone) and terminal input injection. Also sets no_new_privs
    (libseccomp's default)."""
    libc()

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                    ("datum_b", ctypes.c_uint64)]

    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p  # a name (never freed: the worker is short-lived)
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    lib.seccomp_attr_set(ctypes.c_void_p(ctx), SCMP_FLTATR_CTL_OPTIMIZE, 2)  # a binary tree: ~8 tests per call

    def errno_action(code):
        return 0x00050000 | code

    def rule(name, code, *comparisons):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call on this architecture
            return
        array = (ArgCmp * max(1, len(comparisons)))(*[ArgCmp(*c) for c in comparisons])
        result = lib.seccomp_rule_add_array(ctx, errno_action(code), number, len(comparisons), array)
        if result != 0:
            raise OSError(-result, f"seccomp rule for {name}: {os.strerror(-result)}")

    for name in dict.fromkeys(REFUSED_SYSCALLS + (() if counted_memory else UNCOUNTED_MEMORY_SYSCALLS) +
                              (HOST_IPC_SYSCALLS if host_ipc else ())):  # each once
        rule(name, errno.EPERM)
    if host_ipc:
        rule("sendto", errno.EPERM, (4, SCMP_CMP_NE, 0))  # a destination address given
    # the rest is a deny list, except for what this libseccomp does not know: system calls numbered past the last it
    # can name (added to the kernel after it was released) return ENOSYS, as on a kernel without them
    last = max(n for n in range(1024) if lib.seccomp_syscall_resolve_num_arch(0, n))
    for number in range(last + 1, last + 1 + NEWER_SYSCALLS):
        result = lib.seccomp_rule_add_array(ctx, errno_action(errno.ENOSYS), number, 0, None)
        if result != 0:
            raise OSError(-result, f"seccomp rule for system call {number}: {os.strerror(-result)}")
    for kind in (S_IFCHR, S_IFBLK):
        rule("mknod", errno.EPERM, (1, SCMP_CMP_MASKED_EQ, S_IFMT, kind))
        rule("mknodat", errno.EPERM, (2, SCMP_CMP_MASKED_EQ, S_IFMT, kind))
    rule("socket", errno.EAFNOSUPPORT, (0, SCMP_CMP_NE, AF_UNIX))
    rule("socketpair", errno.EAFNOSUPPORT, (0, SCMP_CMP_NE, AF_UNIX))
    for flag in CLONE_NAMESPACES:
        rule("clone", errno.EPERM, (0, SCMP_CMP_MASKED_EQ, flag, flag))
    rule("clone3", errno.ENOSYS)
    rule("ioctl", errno.EPERM, (1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, TIOCSTI))  # the kernel reads 32 bits of it
    result = lib.seccomp_load(ctypes.c_void_p(ctx))
    if result != 0:
        raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


# ---- Landlock: which files the worker may read, write or run, in the kernel, whatever its uid ----
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every architecture
LANDLOCK_RULE_PATH_BENEATH = 1
# access rights to files, by the ABI version that introduced them
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_DIR_CHANGES = sum(1 << k for k in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
LL_MAKE_CHAR, LL_MAKE_BLOCK = 1 << 6, 1 << 11
LL_REFER, LL_TRUNCATE, LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
LL_BIND_TCP, LL_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4: with no rule, no TCP at all
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6: nothing outside the run's domain
ETC_FILES = ("ld.so.cache", "localtime", "passwd", "group", "hosts", "nsswitch.conf")  # unisolated: host /etc


def landlock_rules(writable: tuple, isolated: bool) -> list:
    """(path, "read" | "write" | "device") the worker may use; nothing else of the file system can be opened. The
    isolated root already holds nothing else (this then only repeats it in a second layer); unisolated, it is what
    keeps the host's /tmp, /dev/shm, /proc, the project and its data out of reach."""
    rules = [(p, "read") for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")]
    rules += [(p, "read") for p in (sys.executable, *sys.path)]  # the interpreter (which may run itself again) and
    # its standard library (also where a /proc/self/fd path stands for a directory)
    if isolated:
        rules += [("/etc", "read"), ("/proc", "read")]  # the run's own /etc and its PID namespace's /proc
    else:
        rules += [("/etc/" + name, "read") for name in ETC_FILES]
    rules += [("/dev/" + name, "device") for name in DEVICES]
    return rules + [(p, "write") for p in writable]


def landlock_prepare(abi: int, rules: list) -> int:
    """A Landlock ruleset (its descriptor) handling every right ABI `abi` knows, granting `rules`. Built before the
    uid drop, so that every path in `rules` can still be opened; landlock_restrict_self applies it later."""
    libc()
    fs = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_READ_DIR | LL_DIR_CHANGES
    fs |= (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0) | (LL_IOCTL_DEV if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(fs, LL_BIND_TCP | LL_CONNECT_TCP if abi >= 4 else 0,
                                 LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc().syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    read = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
    file_rights = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | (fs & (LL_TRUNCATE | LL_IOCTL_DEV))
    grants = {"read": read, "device": LL_READ_FILE | LL_WRITE_FILE | (fs & LL_TRUNCATE),
              "write": fs & ~(LL_MAKE_CHAR | LL_MAKE_BLOCK | LL_IOCTL_DEV)}

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    for path, kind in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:  # not on this machine (/lib32, a missing sys.path entry)
            continue
        try:
            allowed = grants[kind]
            if not os.path.isdir(f"/proc/self/fd/{fd}"):
                allowed &= file_rights  # rights on a directory's entries cannot be given on a file
            rule = PathBeneath(allowed, fd)
            if libc().syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0):
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
    return ruleset


def landlock_restrict(ruleset: int) -> None:
    """Apply the ruleset to this process and every process it starts (needs no_new_privs, set before)."""
    _check(libc().syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


# ---- the run's file system ----
def build_root(settings: dict) -> None:
    """Make the file system described in the module docstring and pivot into it (namespace mode only; the
    supervisor is root of its mount namespace). The host's tree stays untouched: every mount is in this mount
    namespace, made private first, and goes away with its last process."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    base = settings["mount_base"]  # an existing host directory, shadowed in this namespace only
    mount("pyrl-sandbox", base, "tmpfs", MS_NOSUID | MS_NODEV, f"size={settings['disk_bytes']},mode=0755")
    root, rw = base + "/root", base + "/rw"
    for path in (root, rw):
        os.mkdir(path, 0o755)
    bind(root, root, writable=True)  # a mount point of its own, for pivot_root
    uid = settings["uid"]
    owner = (uid, uid) if uid is not None else (0, 0)
    for name in ("tmp", "shm", "sandbox"):
        os.mkdir(f"{rw}/{name}", 0o700)
        os.chown(f"{rw}/{name}", *owner)
    write_files(rw + "/sandbox", settings["files"], owner)
    for name in ("proc", "dev", "etc", "sandbox", "tmp"):
        os.mkdir(f"{root}/{name}", 0o755)
    os.mkdir(f"{root}/dev/shm", 0o755)
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            os.mkdir(f"{root}/{name}", 0o755)
            bind(host, f"{root}/{name}")
    for host in sys.path:  # the interpreter's own directories (-I -S: the standard library's), at their host paths
        if os.path.isdir(host) and not os.path.exists(root + host):
            os.makedirs(root + host, 0o755)
            bind(host, root + host)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        bind(f"/dev/{name}", f"{root}/dev/{name}", writable=True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    user = uid if uid is not None else 0
    etc = {"passwd": f"root:x:0:0:root:/:/bin/sh\nsandbox:x:{user}:{user}:sandbox:{WORK}:/bin/sh\n",
           "group": f"root:x:0:\nsandbox:x:{user}:\n", "hosts": "127.0.0.1 localhost sandbox\n",
           "hostname": "sandbox\n"}
    for name, text in etc.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    for name, place in (("sandbox", "sandbox"), ("tmp", "tmp"), ("shm", "dev/shm")):
        bind(f"{rw}/{name}", f"{root}/{place}", writable=True)
    try:  # only the PID namespace's processes; subset=pid also hides the kernel's files (Linux >= 5.8)
        mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "subset=pid")
    except OSError:
        try:
            mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:  # a user namespace under a masked /proc (containers) may not mount one: none at all
            pass
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _check(libc().syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc().umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    libc().sethostname(b"sandbox", 7)


def write_files(work: str, files: dict, owner) -> None:
    """Write the run's files as root, following no symbolic link and replacing nothing (each path is resolved one
    directory descriptor at a time), then give them and `work` to `owner`, the run's uid: before that the uid
    owns nothing there, so nothing can be planted in the way."""
    directory = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    for name, text in files.items():
        *parents, leaf = name.split("/")
        fd = os.open(work, directory)
        try:
            for part in parents:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
                inner = os.open(part, directory, dir_fd=fd)
                os.close(fd)
                fd = inner
            out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
            with open(out, "w", encoding="utf-8") as f:
                os.fchown(out, *owner)
                f.write(text)
        finally:
            os.close(fd)
    os.chown(work, *owner, follow_symlinks=False)


# ---- the audit hook (defence in depth under the kernel's boundary; alone in the unisolated fallback) ----
def make_hook(writable: tuple):
    """The audit hook confining writes to `writable` directories. Every function, table and constant it uses is
    bound here (the tables as read-only copies), so code that later replaces os.*, builtins or this script's
    globals (reachable through frames) cannot change what it checks; nothing outside this closure refers to it."""
    lstat, stat, readlink, getcwd = os.lstat, os.stat, os.readlink, os.getcwd
    fspath, any_, isinstance_, str_, bytes_, int_ = os.fspath, any, isinstance, str, bytes, int
    denied, writes, write_flags, sinks = DENIED, types.MappingProxyType(dict(WRITES)), WRITE_FLAGS, SINKS
    block_prefix, af_unix, permission_error = BLOCK_PREFIX, AF_UNIX, PermissionError
    own_pid, own_group = os.getpid(), os.getpgid(0)
    roots = tuple(writable)
    prefixes = tuple(root + "/" for root in roots)

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
        """Whether `path` (or the file that descriptor `path` refers to) lies inside a writable place."""
        if isinstance_(path, int_):
            path, dir_fd = readlink(f"/proc/self/fd/{path}"), None
        path = as_text(path)
        if dir_fd is not None and dir_fd >= 0 and not path.startswith("/"):
            path = readlink(f"/proc/self/fd/{dir_fd}") + "/" + path
        real = resolve(path)
        return real is not None and (real in roots or real.startswith(prefixes))

    def hook(event, args):
        if event in denied or event.startswith("ctypes."):
            deny(event)
        elif event == "open":
            path, mode, flags = args
            if path is None or isinstance_(path, int_):  # a descriptor already open
                return
            writing = (isinstance_(flags, int_) and flags & write_flags) or (
                isinstance_(mode, str_) and any_(c in mode for c in "wax+"))
            if writing and as_text(path) in sinks:
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
        elif event == "import" and args[0].rpartition(".")[2] in ("_posixsubprocess", "posix"):
            deny(f"importing {args[0]} afresh")  # also under another package (_imp.create_dynamic of the file)
    return hook


def refuse_unaudited() -> None:
    """Calls that raise no audit event are replaced by refusals: _posixsubprocess.fork_exec (subprocess.Popen
    raises its event before forking, but fork_exec can be called directly), os.mknod and os.mkfifo (files made
    anywhere). Loading those modules afresh is refused by the hook's import rule."""
    # lazy: loaded in the worker right before the stubs below replace them (the child's import order matters)
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
    """Unisolated mode, before the uid drop: the interpreter's directories may be unreadable to the new uid (a
    Python under /root), so they are opened now and imported from through /proc/self/fd, which needs no
    permission on the directories above them."""
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


def drop_capabilities() -> None:
    """A user namespace's root (the only uid it maps) keeps no capability: bounding set, then capset to none."""
    for cap in range(CAP_LAST + 1):
        libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 (64-bit capability sets): all zero
    _check(libc().capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


def run_worker(settings: dict, source: str, go: int, status_fd: int) -> None:
    """Set up (drop_privileges_and_limit), wait for the supervisor's go (the cgroups joined), close the status
    descriptor (the code can neither forge the report nor see the parent's end), install the hook, run the code
    as __main__. A failed setup is reported on the status descriptor and never runs the code."""
    try:
        work, writable = drop_privileges_and_limit(settings)
        if settings["audit_hook"]:
            refuse_unaudited()
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the sandbox's failure, not the code's
        os.write(status_fd, f"setup {type(e).__name__} in the worker: {e}\n".encode()[:4000])
        os._exit(SETUP_EXIT)
    if os.read(go, 1) != b"1":  # the supervisor failed to move this process into the run's cgroups
        os._exit(SETUP_EXIT)
    os.close(go)
    os.close(status_fd)
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)  # the code's: KeyboardInterrupt as usual
    filename = "main.py"
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module  # the code's globals, not this script's
    sys.argv = [filename]
    sys.path.insert(0, work)  # modules among the sandbox's files import as a script's neighbours do
    if settings["audit_hook"]:  # off only in pyrl's own tests of what the kernel contains (code past the hook)
        sys.addaudithook(make_hook(writable))
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported as Python reports an uncaught exception
        # lazy: the child imports little; traceback only on an error
        import linecache
        import traceback

        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # the code's lines
        traceback.print_exception(type(e), e, code_frames(e.__traceback__))
        sys.exit(1)


def drop_privileges_and_limit(settings: dict) -> tuple[str, tuple]:
    """The run's uid (or no capabilities), rlimits, no_new_privs, the seccomp filter: -> (work dir, writable)."""
    isolated = settings["mount_base"] is not None
    uid = settings["uid"]
    if isolated:
        os.chdir(WORK)
        work, writable = WORK, WRITABLE
    else:
        work = os.path.realpath(settings["work"])
        writable = (work,)
        if uid is not None:
            keep_imports_reachable()
    ruleset = landlock_prepare(settings["landlock"], landlock_rules(writable, isolated)) \
        if settings["landlock"] else None
    if uid is not None:
        for cap in range(CAP_LAST + 1):
            libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif settings["userns"]:
        drop_capabilities()
    for name, value in settings["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if ruleset is not None:
        landlock_restrict(ruleset)
    if settings["seccomp"]:
        load_seccomp(counted_memory=bool(settings["cgroups"]), host_ipc=not isolated)
    return work, writable


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


def read_settings(fd: int) -> tuple[dict, str]:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    settings = marshal.loads(b"".join(chunks))
    return settings, settings.pop("source")


def main() -> None:
    """The supervisor: set up, fork the worker, move it into the run's cgroups, wait for it or for the parent's end
    (its lifeline pipe closes), report how the worker ended on the status descriptor ("exit N", "signal N" or "setup
    <error>"; in a PID namespace unshare cannot pass a signal on), then exit, which in a PID namespace makes the kernel
    kill whatever the code left running. Without one, the process group is killed instead."""
    # as the PID namespace's init, a signal sent from inside reaches it only if it handles it (Python handles
    # SIGINT): the default disposition makes it immune to the code (a user namespace's code has its uid)
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    # this script came through a memfd passed to the interpreter (sys.argv[0] is /proc/self/fd/N), read whole before
    # main runs; left open, the code would inherit it, at whatever number the host's open files gave it (past the
    # code's descriptor limit, where it takes a slot the limit does not count)
    os.close(int(sys.argv[0].rsplit("/", 1)[1]))
    settings_fd, status_fd, lifeline_fd = (int(x) for x in sys.argv[2:5])  # argv[1]: pyrl.sandbox.SUPERVISOR_MARK
    try:
        settings, source = read_settings(settings_fd)
        cgroups = [os.open(path, os.O_WRONLY) for path in settings["cgroups"]]  # before the host's tree goes
        if settings["mount_base"] is not None:
            build_root(settings)
        else:
            write_files(settings["work"], settings["files"], (settings["uid"],) * 2
                        if settings["uid"] is not None else (os.getuid(), os.getgid()))
    except Exception as e:  # noqa: BLE001 - the parent turns this into an error naming the step
        os.write(status_fd, f"setup {type(e).__name__}: {e}".encode()[:4000])
        os._exit(SETUP_EXIT)
    go_r, go_w = os.pipe()
    worker = os.fork()
    if worker == 0:
        for fd in (lifeline_fd, go_w, *cgroups):
            os.close(fd)
        run_worker(settings, source, go_r, status_fd)
        return
    os.close(go_r)
    # the worker's whole tree is counted: it is moved into the run's cgroups before its code starts (it waits for
    # the go byte). A move can wait ~10 ms on the kernel (an RCU grace period), overlapped with the worker's setup.
    try:
        for fd in cgroups:
            os.write(fd, str(worker).encode())
            os.close(fd)
    except OSError as e:
        os.write(status_fd, f"setup OSError: joining the run's cgroup: {e.strerror}".encode())
        os.kill(worker, 9)
        os._exit(SETUP_EXIT)
    os.write(go_w, b"1")
    os.close(go_w)
    pidfd = os.pidfd_open(worker)
    unisolated = settings["mount_base"] is None
    while True:
        ready, _, _ = select.select([pidfd, lifeline_fd], [], [], DISK_POLL_S if unisolated else None)
        if pidfd in ready:
            break
        if lifeline_fd in ready and not os.read(lifeline_fd, 1):  # the parent is gone: so is the run
            if unisolated:  # and its host directory, which the parent would have removed
                end_unisolated_tree(settings["uid"], settings["work"])
            os._exit(71)
        if unisolated:
            used = disk_usage(settings["work"])
            if used > settings["disk_bytes"]:
                os.write(status_fd, f"disk {used}".encode())
                end_unisolated_tree(settings["uid"])
    _, status = os.waitpid(worker, 0)
    report = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    os.write(status_fd, report.encode())
    if unisolated and settings["uid"] is not None:  # whatever the code left running, wherever it moved
        kill_uid(settings["uid"])


def disk_usage(top: str) -> int:
    """Bytes the run's directory holds: allocated blocks, and at least a block per file, directory or link (so that
    a million empty files count too). Unisolated runs only, whose writes Landlock keeps to that directory."""
    used, todo = 0, [top]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    try:
                        used += max(entry.stat(follow_symlinks=False).st_blocks * 512, 4096)
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                    except OSError:
                        pass
        except OSError:
            pass
    return used


def kill_uid(uid: int) -> None:
    """SIGKILL every process of the run's uid (a daemon that left the process group and session too): a child that
    takes the uid sends kill(-1), which reaches exactly the processes of its uid. A process forked during a pass
    is appended to the kernel's task list, so the same pass reaches it; the later passes are a margin."""
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):
                os.kill(-1, 9)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def end_unisolated_tree(uid, work: str | None = None) -> None:
    """No PID namespace ends this run's processes: the run's uid is swept (root), `work` removed when given, then
    the process group (this supervisor included)."""
    if uid is not None:
        kill_uid(uid)
    if work is not None:
        remove_tree(work)
    os.killpg(0, 9)  # SIGKILL (the signal module costs an import)


def remove_tree(top: str) -> None:
    """Remove a directory tree without following links (the supervisor keeps the permissions to, whatever the code
    did to its own); what cannot be removed is left to the next process's probe."""
    for root, dirs, files in os.walk(top, topdown=False):
        for name in files + dirs:
            path = os.path.join(root, name)
            try:
                os.rmdir(path) if name in dirs and not os.path.islink(path) else os.unlink(path)
            except OSError:
                pass
    try:
        os.rmdir(top)
    except OSError:
        pass


if __name__ == "__main__":
    main()
