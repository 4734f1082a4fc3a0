"""The fused response log-probs equal log_softmax of the HF model's own logits (float64 reference), packed
(remove-padding, varlen attention) and padded alike, values and gradients."""

import pytest
import torch

from pyrl.models import tiny_model_path, varlen_attention
from pyrl.workers.batching import ModelInputs
from pyrl.workers.policy import ResponseLogProbs

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model_path(cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tiny_lm(tiny_path):
    """The model with packed attention registered: padded calls (a [B, L] mask) take sdpa's path."""
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32,
                                                             attn_implementation=varlen_attention.register())


@pytest.fixture(scope="module")
def hf64(tiny_path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)


def _batch(vocab, seed=0, prompt=7, response=6):
    """Left-padded prompts, right-padded responses of very different lengths (one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, prompt + response), generator=g)
    prompt_len = torch.tensor([7, 2, 5, 1])
    response_len = torch.tensor([6, 1, 3, 6])
    cols = torch.arange(prompt + response)
    mask = ((cols >= prompt - prompt_len[:, None]) & (cols < prompt + response_len[:, None])).long()
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids}, response


def _reference(hf64, tensors, r, temperature):
    logits = hf64(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                  position_ids=tensors["position_ids"]).logits / temperature
    ref = torch.log_softmax(logits[:, -r - 1:-1], -1)
    return ref.gather(-1, tensors["input_ids"][:, -r:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_hf_logits(tiny_lm, hf64, packed, temperature, fused):
    """model.use_fused_kernels true (from hidden states) or false (from the lm_head's logits): the same numbers."""
    tensors, r = _batch(tiny_lm.config.vocab_size)
    policy = ResponseLogProbs(tiny_lm, use_fused_kernels=fused)
    logp, entropy = policy(ModelInputs.responses(tensors, r, packed, CPU), temperature=temperature, return_entropy=True)
    expected, expected_entropy = _reference(hf64, tensors, r, temperature)
    mask = tensors["attention_mask"][:, -r:].bool()
    torch.testing.assert_close(logp.double()[mask], expected[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double()[mask], expected_entropy[mask], atol=1e-5, rtol=1e-5)
    if packed:  # nothing is computed for padding
        assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()


def test_gradients_packed_equal_padded_equal_hf(tiny_lm, hf64):
    """d(sum of masked log-probs) for every weight: packed == padded == float64 HF, with a loss mask that has a
    hole (a token attended to but not trained on)."""
    tensors, r = _batch(tiny_lm.config.vocab_size, seed=1)
    loss_mask = tensors["attention_mask"][:, -r:].clone()
    loss_mask[0, 2] = 0  # the hole
    grads = {}
    for packed, fused in ((True, True), (False, True), (True, False)):
        tiny_lm.zero_grad()
        policy = ResponseLogProbs(tiny_lm, use_fused_kernels=fused)
        (policy(ModelInputs.responses(tensors, r, packed, CPU)) * loss_mask).sum().backward()
        grads[packed, fused] = {n: p.grad.clone() for n, p in tiny_lm.named_parameters()}
    hf64.zero_grad()
    expected, _ = _reference(hf64, tensors, r, 1.0)
    (expected * loss_mask).sum().backward()
    for name, p in hf64.named_parameters():
        torch.testing.assert_close(grads[True, True][name].double(), p.grad, atol=2e-5, rtol=1e-4, msg=name)
        for other in ((False, True), (True, False)):
            torch.testing.assert_close(grads[True, True][name], grads[other][name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_packed_equals_padded_equals_hf(tiny_path, dtype, fused):
    """On CUDA (the Triton log-prob kernels, SDPA buckets or flash-attn): packed and padded log-probs, entropy and
    weight gradients against the float64 HF model holding the same (dtype-rounded) weights. fp32 within 1e-4; bf16
    (activations rounded at every layer) packed no further from float64 than HF's own padded sdpa path is."""
    cuda = torch.device("cuda")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=dtype,
                                                              attn_implementation=varlen_attention.register()).to(cuda)
    exact = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    tensors, r = _batch(model.config.vocab_size, seed=4)
    loss_mask = tensors["attention_mask"][:, -r:].clone()
    loss_mask[0, 2] = 0
    weights = torch.randn(loss_mask.shape, generator=torch.Generator().manual_seed(3)) * loss_mask
    exact.zero_grad()
    expected, expected_entropy = _reference(exact, tensors, r, 0.7)
    ((expected * weights).sum() + 0.1 * (expected_entropy * weights).sum()).backward()
    mask = loss_mask.bool()
    policy = ResponseLogProbs(model, use_fused_kernels=fused)
    results = {}
    for packed in (True, False):
        model.zero_grad()
        inputs = ModelInputs.responses({k: v.to(cuda) for k, v in tensors.items()}, r, packed, cuda)
        logp, entropy = policy(inputs, temperature=0.7, return_entropy=True)
        ((logp * weights.to(cuda)).sum() + 0.1 * (entropy * weights.to(cuda)).sum()).backward()
        results[packed] = (logp.detach().cpu().double(), entropy.detach().cpu().double(),
                           {n: p.grad.detach().cpu().double() for n, p in model.named_parameters()})
    for name, p in exact.named_parameters():
        assert p.grad is not None and results[True][2][name].shape == p.grad.shape, name
    if dtype == torch.float32:
        for packed, (logp, entropy, grads) in results.items():
            torch.testing.assert_close(logp[mask], expected[mask].detach(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(entropy[mask], expected_entropy[mask].detach(), atol=1e-4, rtol=1e-4)
            for name, p in exact.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=f"packed={packed} {name}")
        return
    for i, want in enumerate((expected, expected_entropy)):
        err = {packed: (res[i][mask] - want[mask].detach()).abs().max().item() for packed, res in results.items()}
        assert err[True] <= 1.5 * err[False] + 1e-3, f"output {i}: packed max error {err[True]}, padded {err[False]}"
    for name, p in exact.named_parameters():
        err = {packed: (res[2][name] - p.grad).norm().item() / p.grad.norm().clamp_min(1e-12).item()
               for packed, res in results.items()}
        assert err[True] <= 1.5 * err[False] + 1e-3, f"{name}: packed relative error {err[True]}, padded {err[False]}"


def test_bad_inputs_named():
    tensors, r = _batch(300)
    with pytest.raises(ValueError, match="response_length: expected 1..12"):
        ModelInputs.responses(tensors, 13, True, CPU)
    holes = dict(tensors, attention_mask=tensors["attention_mask"].clone())
    holes["attention_mask"][2, 7] = 0  # row 2's attended tokens are no longer one run
    with pytest.raises(ValueError, match="row 2"):
        ModelInputs.responses(holes, r, True, CPU)
    no_prompt = {k: v[:, 6:] for k, v in tensors.items()}  # row 1's prompt (2 tokens) is cut off
    no_prompt["attention_mask"][1, 0] = 0
    with pytest.raises(ValueError, match="row 1: a response token with no prompt token"):
        ModelInputs.responses(no_prompt, r, True, CPU)


@pytest.mark.parametrize("packed_model", [True, False], ids=["packed-model", "padded-model"])
def test_packed_transport_gives_the_same_model_inputs(tiny_lm, packed_model):
    """A micro-batch sent packed (PackedTensors, no attention mask: what the trainer sends) and the same rows
    sent padded give the same trimmed response fields and the same log-probs."""
    from pyrl.protocol import DataProto
    from pyrl.workers.batching import row_lengths, trimmed

    tensors, r = _batch(tiny_lm.config.vocab_size, seed=2)
    padded = DataProto.from_dict({**tensors, "response_mask": tensors["attention_mask"][:, -r:]})
    sent = padded.to_packed("attention_mask", keys=["input_ids", "position_ids"])
    assert "attention_mask" not in sent.batch
    assert torch.equal(row_lengths(sent), row_lengths(padded))
    policy = ResponseLogProbs(tiny_lm)
    results = []
    for data in (padded, sent):
        rows = data.select_idxs([1, 2])  # 2 and 5 prompt tokens, 1 and 3 response tokens: trimming cuts columns
        fields, kept = trimmed(rows, r)
        results.append((fields["response_mask"], policy(ModelInputs.responses(fields, kept, packed_model, CPU))))
    assert results[0][0].shape == results[1][0].shape == (2, 3)
    assert torch.equal(results[0][0], results[1][0])
    seen = results[0][0].bool()  # padding columns are scored from padding: only the attended ones must agree
    torch.testing.assert_close(results[1][1][seen], results[0][1][seen], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_packed_hidden_states_equal_padded_across_model_families(family):
    """The packed call (no mask, the VarlenAttention as a keyword) works for decoder families beyond Qwen2 and
    gives each real token the hidden state the padded call gives it; gradients flow."""
    configs = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
               "mistral": transformers.MistralConfig}
    config = configs[family](vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation=varlen_attention.register()).eval()
    tensors, r = _batch(97, seed=3)
    padded = ModelInputs.responses(tensors, r, False, CPU).hidden_states(model)
    inputs = ModelInputs.responses(tensors, r, True, CPU)
    packed = inputs.hidden_states(model)[0]
    mask = tensors["attention_mask"].bool()
    torch.testing.assert_close(packed, padded[mask], atol=1e-5, rtol=1e-5)
    packed.sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def _grouped_batch(vocab, seed=5):
    """Samples of 3 prompts (of 7, 3 and 5 tokens), not adjacent, in groups of 3, 1 and 2: responses of 0..6
    tokens, the first sample of the first prompt empty (it still gives the prompt's states)."""
    g = torch.Generator().manual_seed(seed)
    prompt, response = 7, 6
    prompts = {0: (7, torch.randint(3, vocab, (7,), generator=g)), 1: (3, torch.randint(3, vocab, (3,), generator=g)),
               2: (5, torch.randint(3, vocab, (5,), generator=g))}
    which = [0, 2, 0, 1, 2, 0]
    response_len = torch.tensor([0, 6, 1, 4, 3, 6])
    rows = len(which)
    ids = torch.zeros(rows, prompt + response, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(which):
        n, tokens = prompts[k]
        ids[i, prompt - n:prompt] = tokens
        mask[i, prompt - n:prompt + int(response_len[i])] = 1
        ids[i, prompt:] = torch.randint(3, vocab, (response,), generator=g)
    return {"input_ids": ids * mask, "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}, response


def test_shared_prompts_give_the_same_log_probs_entropy_and_gradients(tiny_lm, hf64):
    """share_prompts (actor.use_prefix_grouper): each prompt runs once for all its samples; log-probs and entropy
    equal the float64 HF reference, gradients equal the unshared packed path's."""
    tensors, r = _grouped_batch(tiny_lm.config.vocab_size)
    mask = tensors["attention_mask"][:, -r:].bool()
    policy = ResponseLogProbs(tiny_lm)
    shared = ModelInputs.responses(tensors, r, True, CPU, share_prompts=True)
    plain = ModelInputs.responses(tensors, r, True, CPU)
    assert shared.num_tokens == plain.num_tokens - 7 * 2 - 5 * 1  # the repeats of prompts 0 and 2 are gone
    expected, expected_entropy = _reference(hf64, tensors, r, 0.8)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    grads = []
    for inputs in (shared, plain):
        tiny_lm.zero_grad()
        logp, entropy = policy(inputs, temperature=0.8, return_entropy=True)
        torch.testing.assert_close(logp[mask].double(), expected[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[mask].double(), expected_entropy[mask], atol=1e-5, rtol=0)
        assert (logp[~mask] == 0).all()
        ((logp * weights).sum() + 0.1 * (entropy * weights).sum()).backward()
        grads.append({name: p.grad.clone() for name, p in tiny_lm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_shared_prompts_need_the_packed_path(tiny_lm):
    tensors, r = _grouped_batch(tiny_lm.config.vocab_size)
    with pytest.raises(ValueError, match="use_prefix_grouper.*use_remove_padding=true"):
        ModelInputs.responses(tensors, r, False, CPU, share_prompts=True)
