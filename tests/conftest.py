import os

import torch

# Triton kernels run on CPU tensors through the interpreter; it is read when kernels are decorated,
# so it must be set before pyrl.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pyrl.ops._dispatch import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _backends():
    names = ["torch", "triton"] if DEVICE == "cuda" else ["cpp", "torch", "triton"]
    return [pytest.param(n, marks=pytest.mark.skipif(n == "triton" and not triton_available(), reason="no triton"))
            for n in names]


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    """Every op test runs once per backend, forced through PYRL_OPS_BACKEND."""
    monkeypatch.setenv("PYRL_OPS_BACKEND", request.param)
    return request.param


@pytest.fixture(params=[p for p in _backends() if p.values[0] != "torch"])
def kernel_backend(request, monkeypatch):
    """As `backend`, for tests of the kernels' own passes: the backends other than torch's ops."""
    monkeypatch.setenv("PYRL_OPS_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    """Tests that take the `device` fixture (the op tests) run on CUDA where there is one: they belong to the GPU
    suite (`pytest -m gpu`, benchmarks/gpu_suite.sh) beside the tests marked gpu by hand."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs per test, reproducible from the printed seed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.fixture
def spy_calls(monkeypatch):
    """spy_calls(module, *names) -> a list that records the names of those module functions as they are called
    (each still runs): which kernels a path really took."""
    def spy(module, *names):
        calls = []
        for name in names:
            real = getattr(module, name)
            monkeypatch.setattr(module, name,
                                lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
        return calls
    return spy


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every controller/worker/trainer test (it takes ~3 s to start). 4 logical CPUs on
    2 cores: workers mostly wait on each other."""
    import ray

    from pyrl.controller import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_env():
    """For tests that start Ray clusters of their own in subprocesses: a private RAY_TMPDIR (short: Ray's unix
    sockets live under it; Ray keeps the address file a bare ray.init() would follow there) and an env that marks
    every process started with it, which teardown kills (only those), whatever the test's outcome."""
    import shutil
    import signal
    import tempfile

    import psutil

    tmp = tempfile.mkdtemp(prefix="pyrl-ray-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, PYRL_TEST_RAY_TMPDIR=tmp)
    yield env
    marked = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get("PYRL_TEST_RAY_TMPDIR") == tmp:
                marked.append(proc)
        except (psutil.Error, OSError):  # another user's process, or one gone meanwhile
            continue
    for proc in marked:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(marked, timeout=10)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A Hugging Face hub cache (what HF_HUB_CACHE names) holding pyrl's tiny model as the hub model `id`,
    laid out as huggingface_hub writes one: files as blobs named by their hash, a snapshot of links to them per commit,
    refs/main naming the commit. `env` points a subprocess at it, offline."""
    import hashlib
    from types import SimpleNamespace

    from pyrl.models import tiny_model_path

    hub_id, src = "pyrl-test/tiny-qwen2", tiny_model_path()
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / f"models--{hub_id.replace('/', '--')}"
    commit = hashlib.sha1(hub_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in os.listdir(src):
        data = open(os.path.join(src, name), "rb").read()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}
    return SimpleNamespace(id=hub_id, snapshot=str(snapshot), source=src, env=env)


# ---- CI cannot pass by skipping ----
# With PYRL_CI_STRICT=1 (.ci/run sets it), a skipped test fails the session, naming it, unless its reason is one a
# CPU machine honestly has: the test needs CUDA, or this CPU lacks native bf16. A missing vLLM, Triton, Ray,
# transformers or logger would otherwise skip whole modules quietly and CI would pass checking less.
CI_ALLOWED_SKIPS = ("needs CUDA", "this CPU has no native bf16")
_ci_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("PYRL_CI_STRICT") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(allowed in reason for allowed in CI_ALLOWED_SKIPS):
            _ci_skips.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    if _ci_skips:
        modules = sorted({nodeid.split("::")[0] for nodeid, _ in _ci_skips})
        lines = [f"PYRL_CI_STRICT: {len(_ci_skips)} test(s) skipped in {len(modules)} module(s); CI must run them:"]
        lines += [f"  {nodeid}: {reason}" for nodeid, reason in _ci_skips[:50]]
        session.config.get_terminal_writer().line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
