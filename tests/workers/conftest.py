import pytest


@pytest.fixture(scope="session")
def tiny_path():
    from pyrl.models import tiny_model_path

    return str(tiny_model_path())


@pytest.fixture(scope="session")
def tool_tokenizer():
    """The tiny tool-calling tokenizer (hermes-style chat template with tools)."""
    from pyrl.models.tiny import TinyModelSpec, make_tokenizer

    return make_tokenizer(TinyModelSpec(tools=True))
