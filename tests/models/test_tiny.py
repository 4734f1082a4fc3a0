"""The tiny model factory: deterministic, offline, loadable by transformers from its path."""

import json
import os

import pytest
import torch

from pyrl.models import TinyModelSpec, tiny_model_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model_path(cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_same_seed_same_files(tiny_path, tmp_path):
    again = tiny_model_path(cache_dir=str(tmp_path))
    for name in ("tokenizer.json", "config.json"):
        with open(os.path.join(tiny_path, name)) as a, open(os.path.join(again, name)) as b:
            assert a.read() == b.read(), name
    from safetensors.torch import load_file

    w1, w2 = load_file(os.path.join(tiny_path, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    other = tiny_model_path(TinyModelSpec(seed=1), cache_dir=str(tmp_path))
    assert other != again and not torch.equal(load_file(os.path.join(other, "model.safetensors"))["model.embed_tokens.weight"],
                                              w1["model.embed_tokens.weight"])
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]  # made in a temp dir, renamed


def test_loads_with_transformers_and_has_a_chat_template(tiny_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path)
    config = json.load(open(os.path.join(tiny_path, "config.json")))
    assert config["head_dim"] == 64 and config["model_type"] == "qwen2"  # vLLM's CPU attention needs head_dim 64
    assert model.config.vocab_size == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "03+47="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n03+47=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("<answer>150</answer>").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<answer>", "1", "5", "0", "</answer>"]  # digits one by one
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"
    out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), len(tok)) and torch.isfinite(out.logits).all()
