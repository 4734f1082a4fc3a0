"""sum_pi_squared (sum over the vocabulary of pi^2 at each response token, for the optimal token baseline) against
float64 softmax of full logits: the chunked op, the policy forward (packed and padded), and the actor's
old-log-prob pass with actor.calculate_sum_pi_squared."""

import pytest
import torch
from worker_helpers import make_config, random_batch

from pyrl.models import tiny_model_path
from pyrl.workers.batching import ModelInputs
from pyrl.workers.policy import ResponseLogProbs, sum_pi_squared

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def reference(logits, temperature):
    return torch.softmax(logits.double() / temperature, -1).square().sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_op_matches_full_softmax(dtype):
    """600 rows: several chunks (bf16 chunks are a third of fused_linear_logprobs' 256+), logits spread enough
    that pi ranges from near one-hot to near uniform."""
    hidden = (torch.randn(600, 16) * torch.linspace(0.01, 3, 600)[:, None]).to(dtype)
    weight = torch.randn(97, 16).to(dtype)
    logits = (hidden @ weight.t()).double()  # what the chunks see, in the hidden dtype's rounding
    for temperature in (1.0, 0.6):
        out = sum_pi_squared(hidden, weight, temperature)
        assert out.dtype == torch.float32 and out.shape == (600,)
        torch.testing.assert_close(out.double(), reference(logits, temperature), atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model_path(cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def hf64(tiny_path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)


def hf_sum_pi_squared(hf64, batch, temperature):
    width = batch.batch["responses"].shape[1]
    with torch.no_grad():
        logits = hf64(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                      position_ids=batch.batch["position_ids"]).logits
    return reference(logits[:, -width - 1:-1], temperature)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_policy_forward_returns_it_last(tiny_path, hf64, packed):
    from pyrl.models import varlen_attention

    lm = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32,
                                                           attn_implementation=varlen_attention.register())
    batch = random_batch(5, seed=0, vocab=lm.config.vocab_size)
    r = batch.batch["responses"].shape[1]
    policy = ResponseLogProbs(lm)
    inputs = ModelInputs.responses(batch.batch, r, packed, CPU)
    logp, entropy, spp = policy(inputs, temperature=0.7, return_entropy=True, return_sum_pi_squared=True)
    logp_only, spp_only = policy(inputs, temperature=0.7, return_sum_pi_squared=True)
    assert torch.equal(logp, logp_only) and torch.equal(spp, spp_only)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(spp.double()[mask], hf_sum_pi_squared(hf64, batch, 0.7)[mask], atol=1e-6, rtol=1e-5)
    if packed:  # nothing is computed for padding
        assert (spp[~mask] == 0).all()


def test_actor_compute_log_prob_returns_it_when_asked(tiny_path, hf64):
    from pyrl.workers.actor import ActorRolloutRefWorker

    batch = random_batch(5, seed=1)  # row 1: an empty response
    batch.meta_info["temperature"] = 0.8
    for flag in (True, False):
        config = make_config(f"actor_rollout_ref.actor.calculate_sum_pi_squared={flag}",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, "actor")
        worker.init_model()
        out = worker.compute_log_prob(batch)
        if not flag:
            assert set(out.batch) == {"old_log_probs", "entropys"}
            continue
        spp = out.batch["sum_pi_squared"]
        assert spp.shape == batch.batch["responses"].shape
        mask = batch.batch["response_mask"].bool()
        torch.testing.assert_close(spp.double()[mask], hf_sum_pi_squared(hf64, batch, 0.8)[mask], atol=1e-6, rtol=1e-5)
