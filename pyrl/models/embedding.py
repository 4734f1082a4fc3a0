"""A token embedding, out = W[ids], whose backward adds into the float32 weight's .grad in place.

torch's embedding backward makes a dense [V, H] gradient (zeros, with each looked-up row's gradient added in turn)
that autograd then adds to W.grad: with a Qwen2 vocabulary (151,936) and float32 weights that is 0.29 GiB per 512
hidden units, made at the end of every micro-batch's backward, on top of the memory the freed activations leave
with the allocator. Here the rows' gradients are summed per distinct id by the same kernel ([distinct ids, H]
instead of [V, H]) and each sum is added to its row of W.grad (made as zeros when there is none): the same sums,
added in the same order, so the embedding's own gradient is torch's bit for bit on CPU; tied to a head whose
gradient autograd adds, the total matches to rounding (the lookup's part now joins .grad first). The tests check
both.

Only for losses reduced with .backward() over every leaf, as pyrl's updates are: nothing is returned to autograd
for W, so torch.autograd.grad(..., W), backward(inputs=...) leaving W out, and W's tensor hooks would not see this
gradient.

`patch_embeddings(model)` makes the model's input embedding use it (the trainers do with model.use_fused_kernels);
an embedding it cannot run (max_norm, scale_grad_by_freq, sparse gradients, a weight that is not a float32 leaf)
keeps torch's path, checked at each call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from pyrl.models.patch import patch_forwards
from pyrl.ops.fused_linear_logprobs import float32_grad_to_add_into


class EmbeddingIntoGradFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        ids = ctx.saved_tensors[0].reshape(-1)
        weight, padding = ctx.weight, -1 if ctx.padding_idx is None else ctx.padding_idx
        grad_out = grad_out.reshape(-1, weight.shape[1])
        into = float32_grad_to_add_into(weight)
        if into is None:  # a .grad of another kind: torch's dense gradient, for autograd to add
            return None, torch.ops.aten.embedding_dense_backward(grad_out, ids, weight.shape[0], padding, False), None
        if padding >= 0:  # its rows get no gradient, as in torch's backward (masked here: no host sync)
            grad_out = grad_out.masked_fill((ids == padding).unsqueeze(1), 0.0)
        rows, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.ops.aten.embedding_dense_backward(grad_out, inverse, rows.numel(), -1, False)
        into.index_add_(0, rows, summed)  # distinct rows: one addition per element, in any order
        return None, None, None


def adds_into_grad(module: nn.Embedding) -> bool:
    """Whether this call of `module` takes the in-place backward: gradients on, a float32 leaf weight, none of the
    options torch's own backward handles."""
    weight = module.weight
    return (torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf and weight.dtype == torch.float32
            and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse)


def _forward(self, ids):
    if adds_into_grad(self):
        return EmbeddingIntoGradFunction.apply(ids, self.weight, self.padding_idx)
    return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                       self.sparse)


def patch_embeddings(model: nn.Module) -> int:
    """Make `model`'s input embedding (an nn.Embedding) add its gradient into .grad in place. Returns 1 if it was
    patched, 0 if the model's input embedding is another kind of module."""
    embedding = model.get_input_embeddings()
    return patch_forwards(model, lambda module: module is embedding and type(module) is nn.Embedding, _forward)
