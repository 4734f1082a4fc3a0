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


@pytest.fixture(scope="session")
def teacher_path(tmp_path_factory, tiny_path):
    """pyrl:tiny with noise on every weight: another model over the same vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=0.02))
    path = str(tmp_path_factory.mktemp("teacher"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(path)
    return path
