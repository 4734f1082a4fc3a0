"""The fused response log-probs equal log_softmax of the HF model's own logits (float64 reference)."""

import pytest
import torch

from pyrl.models import tiny_model_path
from pyrl.workers.policy import ResponseLogProbs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    path = tiny_model_path(cache_dir=str(tmp_path_factory.mktemp("cache")))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch(vocab, prompt=5, response=4):
    ids = torch.randint(3, vocab, (3, prompt + response))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the prompt
    mask[1, -1] = 0  # right padding of the response
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, position_ids, response


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_hf_logits(tiny_lm, temperature):
    ids, mask, pos, r = _batch(tiny_lm.config.vocab_size)
    policy = ResponseLogProbs(tiny_lm)
    logp, entropy = policy(ids, mask, pos, r, temperature=temperature, return_entropy=True)
    logits = tiny_lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double() / temperature
    ref = torch.log_softmax(logits[:, -r - 1:-1], -1)
    expected = ref.gather(-1, ids[:, -r:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=1e-5)


def test_gradients_match_hf(tiny_lm):
    ids, mask, pos, r = _batch(tiny_lm.config.vocab_size)
    policy = ResponseLogProbs(tiny_lm)
    tiny_lm.zero_grad()
    policy(ids, mask, pos, r).sum().backward()
    ours = {n: p.grad.clone() for n, p in tiny_lm.named_parameters()}
    tiny_lm.zero_grad()
    logits = tiny_lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.log_softmax(logits[:, -r - 1:-1], -1).gather(-1, ids[:, -r:, None]).sum().backward()
    for name, p in tiny_lm.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="response_length: expected 1..8"):
        policy(ids, mask, pos, 9)
