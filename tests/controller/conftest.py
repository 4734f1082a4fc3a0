import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every controller/worker test (it takes ~3 s to start). 4 logical CPUs on 2 cores:
    workers mostly wait on each other."""
    import ray

    from pyrl.controller import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()
