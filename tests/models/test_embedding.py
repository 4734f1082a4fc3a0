"""pyrl.models.embedding: the input embedding whose backward adds into the float32 weight's .grad in place, against
torch's own embedding backward (bit for bit) and a hand-written sum of rows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pyrl.models.embedding import adds_into_grad, patch_embeddings
from pyrl.ops import fused_linear_logprobs


def patched_copy(module: nn.Embedding) -> nn.Embedding:
    copy = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                        max_norm=module.max_norm, scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse)
    copy.weight.data.copy_(module.weight.data)

    class Holder(nn.Module):  # patch_embeddings takes a model with get_input_embeddings
        def __init__(self):
            super().__init__()
            self.embed = copy

        def get_input_embeddings(self):
            return self.embed

    assert patch_embeddings(Holder()) == 1
    return copy


def micro_batches(vocab, count=3):
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (int(torch.randint(1, 5, ())), int(torch.randint(1, 9, ()))))
        ids[0, 0] = ids[-1, -1]  # a repeated id in every batch
        out.append((ids, torch.randn(*ids.shape, 12)))
    return out


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_gradient_equals_torchs_bit_for_bit_over_micro_batches(padding_idx):
    vocab = 40
    plain = nn.Embedding(vocab, 12, padding_idx=padding_idx)
    patched = patched_copy(plain)
    batches = micro_batches(vocab)
    batches[1][0][0, :2] = 3  # the padding id, twice
    for ids, g in batches:
        for module in (plain, patched):
            out = module(ids)
            assert out.shape == (*ids.shape, 12)
            (out * g).sum().backward()
        assert torch.equal(patched.weight.grad, plain.weight.grad)
    # the sum of rows, written by hand
    expected = torch.zeros(vocab, 12, dtype=torch.float64)
    for ids, g in batches:
        for i, row in zip(ids.flatten().tolist(), g.reshape(-1, 12).double()):
            if row is not None and i != padding_idx:
                expected[i] += row
    torch.testing.assert_close(patched.weight.grad.double(), expected, atol=1e-6, rtol=1e-6)
    if padding_idx is not None:
        assert patched.weight.grad[padding_idx].abs().max() == 0


def test_no_dense_vocabulary_sized_gradient_is_made():
    """The backward makes nothing of the vocabulary's size but the .grad it adds into (once, when absent)."""
    vocab = 1000
    module = patched_copy(nn.Embedding(vocab, 8))

    class VocabSized(TorchDispatchMode):
        made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ret = func._schema.returns
            if ret and ret[0].alias_info is None and isinstance(out, torch.Tensor) and out.shape[:1] == (vocab,):
                VocabSized.made.append(func.__name__)
            return out

    ids = torch.randint(0, vocab, (4, 6))
    for _ in range(2):
        out = module(ids)
        with VocabSized():
            out.sum().backward()
    assert VocabSized.made == ["zeros_like.default"]  # the first backward's .grad


def test_tied_to_the_fused_head_equals_autograd():
    """A Qwen2-style tie: the fused log-prob head and the lookup read one weight; both add into its .grad (the head
    first, making it), and the sum equals plain autograd's through F.embedding and the head's own gradient."""
    vocab, hidden = 97, 16
    plain = nn.Embedding(vocab, hidden)
    patched = patched_copy(plain)
    for _ in range(3):
        ids, labels = torch.randint(0, vocab, (2, 5)), torch.randint(0, vocab, (10,))
        g = torch.randn(10)
        for module, into in ((plain, False), (patched, True)):
            h = module(ids).reshape(-1, hidden).tanh()
            logp = fused_linear_logprobs(h, module.weight, labels, chunk_size=4, grad_into_weight=into)
            (logp * g).sum().backward()
    torch.testing.assert_close(patched.weight.grad, plain.weight.grad, atol=1e-6, rtol=1e-5)


def test_torchs_path_where_it_cannot_add_in_place():
    module = patched_copy(nn.Embedding(10, 4, max_norm=1.0))
    assert not adds_into_grad(module)
    module = patched_copy(nn.Embedding(10, 4))
    assert adds_into_grad(module)
    with torch.no_grad():
        assert not adds_into_grad(module)
    module.weight.data = module.weight.data.bfloat16()
    assert not adds_into_grad(module)
    ids = torch.tensor([[1, 2, 2]])
    module(ids).sum().backward()  # torch's backward: a bf16 weight's gradient
    assert module.weight.grad.dtype == torch.bfloat16 and module.weight.grad[2].eq(2).all()


def test_a_model_whose_input_embedding_is_not_an_embedding_is_left_alone():
    class Other(nn.Module):
        def get_input_embeddings(self):
            return nn.Linear(3, 3)

    assert patch_embeddings(Other()) == 0


def test_patched_policy_model_equals_the_unpatched_one():
    from transformers import AutoModelForCausalLM

    from pyrl.models import tiny_model_path

    plain, patched = (AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32) for _ in range(2))
    assert patch_embeddings(patched) == 1
    ids = torch.randint(3, plain.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    for _ in range(2):  # the second micro-batch adds into the first one's .grad
        for model in (plain, patched):
            loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
    embed = plain.get_input_embeddings().weight
    for (name, p), q in zip(plain.named_parameters(), patched.parameters()):
        if p is embed and plain.config.tie_word_embeddings:  # the head's gradient is added after the lookup's, not
            torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-6)  # with it: rounding from the second
        else:
            assert torch.equal(q.grad, p.grad), name
