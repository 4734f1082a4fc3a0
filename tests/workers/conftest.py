import pytest


@pytest.fixture(scope="session")
def tiny_path():
    from pyrl.models import tiny_model_path

    return str(tiny_model_path())
