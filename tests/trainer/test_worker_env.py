"""What pyrl's CPU worker processes start with, besides the config: glibc malloc thresholds that keep a large
micro-batch's activations on the heap (pyrl.trainer.workers.CPU_MALLOC_ENV; benchmarks/micro_batch_sizes.py
measures why), unless the user set their own."""

import subprocess
import sys

from pyrl.trainer.workers import CPU_MALLOC_ENV, cpu_malloc_env


def test_cpu_workers_get_fixed_malloc_thresholds_unless_the_user_set_them(monkeypatch):
    for key in CPU_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert cpu_malloc_env() == {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert cpu_malloc_env()["MALLOC_TRIM_THRESHOLD_"] == "0"


def test_glibc_reads_them_a_freed_block_stays_on_the_heap():
    """With the thresholds, a 16 MiB block comes from the heap (brk) and, freed, stays there: the second one is
    the same memory, no new mapping; with glibc's defaults it is a fresh mmap each time."""
    probe = ("import ctypes, re\n"
             "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]\n"
             "heap = lambda: sum(1 for line in open('/proc/self/maps') if '[heap]' in line)\n"
             "a = libc.malloc(16 << 20); inside = any(int(lo, 16) <= a < int(hi, 16) for lo, hi in\n"
             "    (re.match(r'([0-9a-f]+)-([0-9a-f]+) .*\\[heap\\]', l).groups() for l in open('/proc/self/maps')\n"
             "     if '[heap]' in l))\n"
             "libc.free(a); b = libc.malloc(16 << 20)\n"
             "print(inside, a == b)\n")
    base = {"PATH": "/usr/bin:/bin"}
    tuned = subprocess.run([sys.executable, "-c", probe], env={**base, **CPU_MALLOC_ENV}, capture_output=True,
                           text=True, check=True).stdout.split()
    plain = subprocess.run([sys.executable, "-c", probe], env=base, capture_output=True, text=True,
                           check=True).stdout.split()
    assert tuned == ["True", "True"] and plain[0] == "False"
