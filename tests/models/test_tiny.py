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

    w1, w2 = (load_file(os.path.join(tiny_path, "model.safetensors")),
              load_file(os.path.join(again, "model.safetensors")))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    other = tiny_model_path(TinyModelSpec(seed=1), cache_dir=str(tmp_path))
    assert other != again and not torch.equal(
        load_file(os.path.join(other, "model.safetensors"))["model.embed_tokens.weight"],
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


@pytest.mark.parametrize("eos_prob", [0.05, 0.3])
def test_eos_biased_model_emits_eos_at_the_asked_rate(tmp_path, eos_prob):
    """The benchmark's EOS-biased variant: p(EOS) near eos_prob at every position of fresh random prompts (not
    the calibration's), untied embeddings, and an invalid probability named."""
    from pyrl.models.tiny import eos_biased_model_path

    spec = TinyModelSpec()
    path = eos_biased_model_path(spec, eos_prob, cache_dir=str(tmp_path))
    assert eos_biased_model_path(spec, eos_prob, cache_dir=str(tmp_path)) == path  # cached
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path(spec, str(tmp_path)), dtype=torch.float32)
    eos = model.config.eos_token_id
    ids = torch.randint(3, model.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        p_eos = model(input_ids=ids).logits.softmax(-1)[..., eos]
    assert abs(p_eos.mean().item() - eos_prob) < 0.35 * eos_prob
    assert p_eos.min().item() > eos_prob / 3 and p_eos.max().item() < min(1.0, 3 * eos_prob)
    assert not model.config.tie_word_embeddings and base.config.tie_word_embeddings
    with pytest.raises(ValueError, match="eos_prob: expected a probability in"):
        eos_biased_model_path(spec, 1.5, cache_dir=str(tmp_path))
