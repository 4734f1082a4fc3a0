"""pyrl.sandbox: what untrusted code may and may not do, that every run ends within its limits leaving no process,
no directory and no cgroup behind, that the async form runs many at once without blocking the event loop, and that
a machine without a kernel boundary refuses to run code unless allowed to.

The cases that matter for safety run in three modes (sandbox_leftovers.isolation_for): "isolated", what this machine
allows (namespaces, the run's own uid as root, seccomp, a cgroup; skipped where the kernel gives no boundary);
"unisolated", the same without namespaces (a machine without unshare); "hook-only", the audit hook and the resource
limits alone. Attacks that get past the hook are in test_attacks.py."""

import asyncio
import logging
import os
import socket
import sys
import time
import tracemalloc

import pytest

import pyrl.sandbox as sandbox
from pyrl.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_code_async

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox_leftovers import MODES, adopt_orphans, isolation_for, leftovers, unavailable  # noqa: E402

SMALL = SandboxLimits(wall_s=5, cpu_s=1, memory_mb=256, max_processes=16, max_output_bytes=4096)


def run_code(code, **kwargs):
    """pyrl.sandbox.run_code, also on a machine without a kernel boundary (the default deny has tests of its own)."""
    return sandbox.run_code(code, allow_unisolated=True, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    """Whatever a run leaves behind is re-parented to this process (see sandbox_leftovers)."""
    adopt_orphans(True)
    yield
    adopt_orphans(False)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After each test (a cancelled run's thread may still be cleaning up: up to 5 s) no process of its runs may be
    alive (a uid of the runs' range or the supervisor's script on the command line, among this process's
    descendants), no host directory of an unisolated run and no run's cgroup may be left."""
    yield
    assert leftovers() == {}, "a sandboxed process, directory or cgroup outlived its run"


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    reason = unavailable(request.param)
    if reason:
        pytest.skip(reason)
    iso = isolation_for(request.param)
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    return request.param


def test_ok_with_stdin_stdout_and_files():
    code = "import helper\nname = input()\nprint(helper.greet(name))\nprint(open('data/n.txt').read().strip())\n"
    result = run_code(code, stdin="sandbox\n", limits=SMALL,
                      files={"helper.py": "def greet(n):\n    return 'hello ' + n\n", "data/n.txt": "42\n"})
    assert isinstance(result, SandboxResult)
    assert result.ok and result.status == "ok" and result.returncode == 0, result
    assert result.stdout == "hello sandbox\n42\n" and result.stderr == ""
    assert 0 < result.wall_s < 5 and "exited normally" in result.message


def test_writes_inside_its_directory_are_allowed():
    code = ("import os, tempfile\nos.makedirs('a/b')\nopen('a/b/c.txt', 'w').write('x')\n"
            "os.rename('a/b/c.txt', 'd.txt')\n"
            "tempfile.NamedTemporaryFile(delete=True).close()\nprint(sorted(os.listdir('.')))")
    result = run_code(code, limits=SMALL)
    assert result.ok, result
    assert result.stdout == "['a', 'd.txt']\n"


def test_exception_is_an_error_with_the_traceback():
    result = run_code("def f():\n    return 1 / 0\nf()\n", limits=SMALL)
    assert result.status == "error" and result.returncode == 1 and not result.ok
    assert "Traceback (most recent call last)" in result.stderr and 'File "main.py", line 2, in f' in result.stderr
    assert "_child.py" not in result.stderr  # the sandbox's own frames are not the code's
    assert result.message == "exited with code 1: ZeroDivisionError: division by zero"
    syntax = run_code("def (:\n", limits=SMALL)
    assert syntax.status == "error" and "SyntaxError" in syntax.message
    exit_code = run_code("import sys\nsys.exit(3)", limits=SMALL)
    assert exit_code.status == "error" and exit_code.returncode == 3


def test_cpu_bound_loop_times_out_and_its_process_is_gone():
    result = run_code("while True:\n    pass\n", limits=SandboxLimits(wall_s=10, cpu_s=1))
    assert result.status == "timeout" and "CPU time limit of 1 s" in result.message, result
    assert result.wall_s < 5  # and the fixture finds no process left


def test_sleeping_past_the_wall_clock_times_out(mode):
    code = "import time\ntime.sleep(60)\n"
    start = time.monotonic()
    result = run_code(code, limits=SandboxLimits(wall_s=1, cpu_s=5))
    assert result.status == "timeout" and "wall-clock limit of 1 s" in result.message, result
    assert result.returncode is None and time.monotonic() - start < 3  # and the fixture finds no process left


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()\n",
    "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'pass'])\n",
    "import os\nwhile True:\n    os.posix_spawn('/bin/sh', ['sh', '-c', 'sleep 60'], {})\n",
    "import _posixsubprocess\n_posixsubprocess.fork_exec()\n",
    "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()\n",
], ids=["os.fork", "subprocess", "posix_spawn", "fork_exec", "multiprocessing"])
def test_fork_bombs_are_stopped(bomb, mode):
    result = run_code(bomb, limits=SMALL)
    assert result.status == "blocked" and "is not allowed" in result.message, result  # the hook refuses the first
    # and the fixture finds no process left


def test_threads_beyond_max_processes_fail_where_the_kernel_counts_them():
    iso = sandbox.isolation()
    if os.geteuid() == 0 and not iso.drop_uid and iso.cgroup is None:
        pytest.skip("root without the uid drop or a pids cgroup: RLIMIT_NPROC does not apply to root")
    code = ("import threading, time\nthreads = []\nfor i in range(64):\n"
            "    t = threading.Thread(target=time.sleep, args=(1,))\n    t.start()\n    threads.append(t)\n")
    result = run_code(code, limits=SandboxLimits(wall_s=5, max_processes=8))
    assert result.status == "error" and "can't start new thread" in result.stderr, result


def test_allocating_without_end_hits_the_memory_limit():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n"
    result = run_code(code, limits=SandboxLimits(wall_s=10, cpu_s=5, memory_mb=128))
    assert result.status == "memory" and "memory limit of 128 MB" in result.message, result
    assert run_code("x = bytearray(1 << 30)", limits=SMALL).status == "memory"


def test_megabytes_of_output_are_cut_at_the_cap_with_bounded_parent_memory():
    tracemalloc.start()
    try:
        result = run_code("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
                          limits=SandboxLimits(wall_s=10, max_output_bytes=65536))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == "output_limit" and "stdout passed the limit of 65536 bytes" in result.message, result
    assert result.stdout == "x" * 65536
    assert peak < 4 << 20, f"the parent held {peak} bytes for a capped output of 64 KiB"
    flood = run_code("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n", limits=SMALL)
    assert flood.status == "output_limit" and flood.message.startswith("stderr") and len(flood.stderr) == 4096


def test_no_network_even_to_a_listener_on_localhost(mode):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for code in (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')\n",
                     f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
                     f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)\n",
                     f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                     f"s.sendto(b'hi', ('127.0.0.1', {port}))\n"):
            result = run_code(code, limits=SMALL)
            assert result.status == "blocked" and "no network" in result.message, (code, result)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    # local socket pairs (asyncio's self-pipe) still work
    assert run_code("import asyncio\nasyncio.run(asyncio.sleep(0))\nprint('ok')", limits=SMALL).stdout == "ok\n"


def test_no_writing_outside_its_directory(tmp_path, mode):
    target = tmp_path / "written.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    attempts = {
        "open": f"open({str(target)!r}, 'w').write('x')",
        "os.open": f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        "pathlib": f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        "remove": f"import os\nos.remove({str(keep)!r})",
        "rename": f"import os\nos.rename({str(keep)!r}, 'stolen.txt')",
        "chmod": f"import os\nos.chmod({str(keep)!r}, 0o777)",
        "symlink": f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
        "dir_fd": f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                  "os.open('written.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
        "chdir": f"import os\nos.chdir({str(tmp_path)!r})\nopen('written.txt', 'w').write('x')",
        "mkdir": f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        "mknod": f"import os\nos.mknod({str(target)!r})",
    }
    for name, code in attempts.items():
        result = run_code(code, limits=SMALL)
        assert not result.ok and result.status in ("blocked", "error"), (name, result)
        if mode == "hook-only":
            assert result.status == "blocked", (name, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "precious" and oct(keep.stat().st_mode & 0o777) != "0o777"


def test_the_code_gets_none_of_the_parents_environment(monkeypatch):
    monkeypatch.setenv("PYRL_SECRET_TOKEN", "hunter2")
    result = run_code("import os\nprint(sorted(os.environ))", limits=SMALL)
    assert result.ok and "PYRL_SECRET_TOKEN" not in result.stdout and "hunter2" not in result.stdout


def test_the_devices_a_program_may_use_work(mode):
    code = ("import os\nopen('/dev/null', 'w').write('x')\nprint(len(open('/dev/urandom', 'rb').read(16)),"
            " open('/dev/zero', 'rb').read(2), len(os.urandom(8)))\n")
    result = run_code(code, limits=SMALL)
    assert result.ok and result.stdout == "16 b'\\x00\\x00' 8\n", result


def test_without_a_kernel_boundary_code_is_refused_naming_what_is_missing_and_the_key(monkeypatch):
    for name in ("unisolated", "hook-only"):
        iso = isolation_for(name)
        monkeypatch.setattr(sandbox, "isolation", lambda: iso)
        assert not iso.kernel_boundary
        with pytest.raises(SandboxUnavailable, match=r"missing namespaces \(unshare: not found\).*"
                                                     r"reward\.sandbox\.allow_unisolated=true"):
            sandbox.run_code("print(1)", limits=SMALL)
        with pytest.raises(SandboxUnavailable, match="reward.sandbox.allow_unisolated"):
            asyncio.run(sandbox.run_code_async("print(1)", limits=SMALL))
    # and the fixture finds that nothing was started


def test_allowed_to_run_without_a_kernel_boundary_it_runs_and_warns_once_per_process(monkeypatch, caplog):
    iso = isolation_for("unisolated")
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    with caplog.at_level(logging.WARNING, logger="pyrl.sandbox"):
        results = [sandbox.run_code("print(1)", limits=SMALL, allow_unisolated=True) for _ in range(2)]
        results.append(asyncio.run(sandbox.run_code_async("print(1)", limits=SMALL, allow_unisolated=True)))
    assert all(r.ok and r.stdout == "1\n" for r in results), results
    warnings = [r for r in caplog.records if "WITHOUT a kernel boundary" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "missing namespaces (unshare: not found)" in warnings[0].getMessage()


def test_with_a_kernel_boundary_nothing_is_refused_or_warned(monkeypatch, caplog):
    reason = unavailable("isolated")
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    with caplog.at_level(logging.WARNING, logger="pyrl.sandbox"):
        result = sandbox.run_code("print(1)", limits=SMALL)  # allow_unisolated not needed
    assert result.ok and not [r for r in caplog.records if "kernel boundary" in r.getMessage()]


def test_async_runs_at_once_without_blocking_the_loop():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(run_code_async(f"import time\ntime.sleep(0.8)\nprint({i})", limits=SMALL,
                                                        allow_unisolated=True)
                                         for i in range(6)))
        elapsed = time.monotonic() - start
        ticking.cancel()
        return results, elapsed, ticks

    results, elapsed, ticks = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)] and all(r.ok for r in results)
    assert elapsed < 6 * 0.8, f"6 runs of 0.8 s took {elapsed:.1f} s: not concurrent"
    assert ticks >= 0.5 * elapsed / 0.02, "the event loop was blocked"


def test_cancelling_an_async_run_kills_it_at_once():
    async def main():
        task = asyncio.create_task(run_code_async("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=60),
                                                 allow_unisolated=True))
        await asyncio.sleep(0.5)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    assert asyncio.run(main()) < 1  # and the fixture finds the process and the directory gone


@pytest.mark.parametrize("call, message", [
    (lambda: run_code("print(1)", language="cpp"), "language: 'cpp' is not supported; supported: python"),
    (lambda: run_code(b"print(1)"), "code: expected the program's source text"),
    (lambda: run_code("", stdin=None), "stdin: expected text"),
    (lambda: run_code("", limits={"wall_s": 1}), "limits: expected a pyrl.sandbox.SandboxLimits"),
    (lambda: run_code("", files={"../x.py": ""}), "files: '../x.py' is not a relative path"),
    (lambda: run_code("", files={"/etc/x": ""}), "files: '/etc/x' is not a relative path"),
    (lambda: run_code("", files={"x.py": b""}), r"files\['x.py'\]: expected text"),
    (lambda: SandboxLimits(wall_s=0), "SandboxLimits.wall_s: expected a positive number of seconds, got 0"),
    (lambda: SandboxLimits(cpu_s=float("inf")), "SandboxLimits.cpu_s"),
    (lambda: SandboxLimits(memory_mb=1.5), "SandboxLimits.memory_mb: expected an integer >= 1, got 1.5"),
    (lambda: SandboxLimits(max_processes=0), "SandboxLimits.max_processes: expected an integer >= 1"),
    (lambda: SandboxLimits(max_output_bytes=True), "SandboxLimits.max_output_bytes"),
    (lambda: asyncio.run(run_code_async("", language="java")), "language: 'java' is not supported"),
])
def test_bad_arguments_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_each_run_in_one_process_gets_a_uid_of_its_own():
    """uid = UID_BASE + (pid << 8 | slot): no two runs at once share one (two live processes never share a pid),
    and a slot is free again once its run ends."""
    uids = [sandbox._take_uid() for _ in range(sandbox.UID_SLOTS)]
    try:
        assert len(set(uids)) == sandbox.UID_SLOTS
        assert all(sandbox.UID_BASE <= u < sandbox.UID_BASE + sandbox.UID_SPAN and u >> 8 == (
            sandbox.UID_BASE >> 8) + os.getpid() for u in uids)
        with pytest.raises(sandbox.SandboxError, match="more than 256 runs at once"):
            sandbox._take_uid()
    finally:
        for u in uids:
            sandbox._release_uid(u)
    again = sandbox._take_uid()
    sandbox._release_uid(again)
    assert again == uids[0]


def test_files_are_written_through_no_symbolic_link(tmp_path):
    """The supervisor writes the run's files as root: a link planted where a file goes is never followed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pyrl_sandbox_child", sandbox.CHILD)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    work, target = tmp_path / "work", tmp_path / "target"
    work.mkdir()
    (work / "data.txt").symlink_to(target)
    (work / "d").symlink_to(tmp_path)
    for name in ("data.txt", "d/x.txt"):
        with pytest.raises(OSError):
            child.write_files(str(work), {name: "planted"}, (os.getuid(), os.getgid()))
    assert not target.exists() and not (tmp_path / "x.txt").exists()


def test_memory_no_cgroup_counts_is_refused_without_one(mode):
    """A memfd holds memory no rlimit counts: refused by the filter where no cgroup counts the run's memory."""
    iso = sandbox.isolation()
    result = run_code("import os\ntry:\n    os.memfd_create('x')\n    print('made')\nexcept OSError as e:\n"
                      "    print(e.errno)\n")
    assert result.ok, result
    refused = iso.seccomp and iso.cgroup is None
    assert result.stdout.strip() == ("1" if refused else "made"), (iso.describe(), result)


def test_the_code_inherits_only_its_standard_streams():
    """Whatever this process holds open (here 80 more files, numbered past the code's limit of 64), the code's
    process starts with descriptors 0-2 only: nothing of the host's, nor the sandbox's own memfds and pipes."""
    held = [open(os.devnull) for _ in range(80)]  # noqa: SIM115 - held open across the run
    try:
        result = run_code("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n",
                          limits=SandboxLimits(max_open_files=64))
    finally:
        for f in held:
            f.close()
    assert result.ok and result.stdout.strip() == "[0, 1, 2, 3]", result  # 3: listdir's own


def test_open_files_are_limited_per_process():
    result = run_code("import os\nopen_before = len(os.listdir('/proc/self/fd')) - 1  # less listdir's own\nfds = []\n"
                      "try:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
                      "except OSError as e:\n    print(open_before + len(fds), e.errno)\n",
                      limits=SandboxLimits(max_open_files=64))
    assert result.ok and result.stdout.split() == ["64", "24"], result  # EMFILE at the limit
