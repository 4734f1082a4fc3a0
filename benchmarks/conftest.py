import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


class _SyncedBenchmark:
    """pytest-benchmark's fixture, but each timed call waits for the GPU: CUDA launches are
    asynchronous, so unsynchronized timings would measure only the launch."""

    def __init__(self, benchmark):
        self._benchmark = benchmark

    def __call__(self, fn, *args, **kwargs):
        def synced(*a, **k):
            out = fn(*a, **k)
            torch.cuda.synchronize()
            return out

        return self._benchmark(synced, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._benchmark, name)

    def __setattr__(self, name, value):
        if name == "_benchmark":
            object.__setattr__(self, name, value)
        else:
            setattr(self._benchmark, name, value)


@pytest.fixture
def benchmark(benchmark, request):
    if "device" in request.fixturenames and request.getfixturevalue("device") == "cuda":
        return _SyncedBenchmark(benchmark)
    return benchmark
