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
    return [pytest.param(n, marks=pytest.mark.skipif(n == "triton" and not triton_available(), reason="no triton")) for n in names]


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    """Every op test runs once per backend, forced through PYRL_OPS_BACKEND."""
    monkeypatch.setenv("PYRL_OPS_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs per test, reproducible from the printed seed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every controller/worker/trainer test (it takes ~3 s to start). 4 logical CPUs on
    2 cores: workers mostly wait on each other."""
    import ray

    from pyrl.controller import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()
