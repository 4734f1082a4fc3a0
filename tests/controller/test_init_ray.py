"""init_ray: without trainer.ray_address (or $RAY_ADDRESS) a run starts a private Ray instance and never joins
another; `auto`, an address or $RAY_ADDRESS join one. Every case runs in a subprocess with its own RAY_TMPDIR
(where Ray keeps the address file that a bare ray.init() would follow), so neither the cluster started here nor
its address file reaches other runs, and cleanup kills only the processes started here."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
# modes: private (no address), auto (trainer.ray_address=auto), env ($RAY_ADDRESS = the address file's cluster);
# prints {mode: [the GCS it got, its CPUs, its idle worker processes 3 s after the start (private: the instance
# started here; the others' are the head's)]}
DRIVER = """
import json, os, sys, time
import psutil, ray
from pyrl.controller import init_ray

def idle_workers():
    found = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            found += (proc.info["cmdline"] or [""])[0] == "ray::IDLE" and \\
                proc.environ().get("PYRL_TEST_RAY_TMPDIR") == os.environ["PYRL_TEST_RAY_TMPDIR"]
        except psutil.Error:
            pass
    return found

seen = {}
for mode in sys.argv[1:]:
    if mode == "env":
        os.environ["RAY_ADDRESS"] = open(os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster")).read()
    init_ray("auto" if mode == "auto" else None, num_cpus=2)
    if mode == "private":
        time.sleep(3)  # Ray prestarts its idle workers as the driver connects
    seen[mode] = [ray.get_runtime_context().gcs_address, ray.cluster_resources().get("CPU"),
                  idle_workers() if mode == "private" else None]
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
print(json.dumps(seen))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def drive(env, *modes) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, *modes], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.skipif(not os.path.exists(RAY_CLI), reason="no ray command line next to this python")
def test_without_an_address_a_run_keeps_to_its_own_ray(ray_env):
    """Someone's `ray start --head` on the machine: the run starts beside it (a bare ray.init() would join it and
    fail with "When connecting to an existing cluster, num_cpus and num_gpus must not be provided"), and the
    cluster still answers after; `auto` and $RAY_ADDRESS join it."""
    head = subprocess.Popen([RAY_CLI, "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats"], env=ray_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address_file = os.path.join(ray_env["RAY_TMPDIR"], "ray", "ray_current_cluster")
    deadline = time.monotonic() + 90
    while not os.path.exists(address_file):
        assert head.poll() is None, head.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "ray start --head did not come up in 90 s"
        time.sleep(0.2)
    address = open(address_file).read().strip()
    seen, _ = drive(ray_env, "private", "auto", "env")
    assert seen["private"][0] != address and seen["private"][1] == 2
    assert [seen["auto"][:2], seen["env"][:2]] == [[address, 1]] * 2
    head.stderr.close()


def test_a_stale_address_file_does_not_stop_a_run(ray_env):
    """A crashed run's address file, naming a cluster long gone, is no reason to fail; nor does the private
    instance print Ray's token-authentication warning, nor start Ray's idle worker per CPU (pyrl's workers, actors
    with their own runtime_env, would never use them)."""
    os.makedirs(os.path.join(ray_env["RAY_TMPDIR"], "ray"))
    with open(os.path.join(ray_env["RAY_TMPDIR"], "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{_free_port()}")
    seen, stderr = drive(ray_env, "private")
    assert seen["private"][1:] == [2, 0]
    assert "Token authentication" not in stderr and "Started a local Ray instance" in stderr
