"""The critic worker: the LM body with a scalar value head (HF token classification, 1 label) on FSDP2.
The value of response token t is the head's output on the state before it (columns [P-1, P+R-1))."""

from __future__ import annotations

import torch
from torch import nn

from pyrl import ops
from pyrl.controller import Dispatch, Worker, register
from pyrl.protocol import DataProto
from pyrl.seeding import derive_seed
from pyrl.workers import batching, checkpoint, fsdp, lora, optim
from pyrl.workers.batching import ModelInputs
from pyrl.workers.distributed import worker_device
from pyrl.workers.models import load_tokenizer, load_value_model, resolve_model_path
from pyrl.workers.update import UpdatePlan, run_update


class ResponseValues(nn.Module):
    """The value model's body, then its scalar head on the states `inputs` scores -> values [rows, width]
    (FSDP2 root module). The value of response token t is the head's output on the state before it."""

    def __init__(self, value_model: nn.Module):
        super().__init__()
        self.value_model = value_model

    # properties, not attributes: a second registration of the same modules would list their weights twice
    # in the state dict
    @property
    def body(self) -> nn.Module:
        return getattr(self.value_model, self.value_model.base_model_prefix)

    @property
    def head(self) -> nn.Module:
        return getattr(self.value_model, "score", None) or self.value_model.classifier

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        hidden = inputs.hidden_states(self.body)
        return inputs.scatter(self.head(inputs.scored_states(hidden))[:, 0].float())


class CriticWorker(Worker):
    def __init__(self, config, rollout_n: int = 1):
        super().__init__()
        self.config, self.rollout_n = config, rollout_n
        self.device = worker_device(self.local_rank)
        self.packed = config.model.use_remove_padding

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.config.data_loader_seed)  # the new value head starts equal on every rank
        self.tokenizer = load_tokenizer(self.config.model)
        self.value_model = load_value_model(self.config.model)
        self.peft_model = None
        if lora.uses_lora(self.config.model):  # adapters on the body; the new value head trains whole
            self.peft_model = lora.add_adapters(self.value_model, self.config.model, "TOKEN_CLS", "critic.model")
        torch.manual_seed(derive_seed(self.config.data_loader_seed, "dropout", rank=self.rank))
        self.critic = ResponseValues(self.value_model)
        self.compute_dtype = fsdp.fsdp_wrap(self.critic, self.critic.body.layers, self.config.fsdp, self.device)
        self.optimizer = optim.build_optimizer([p for p in self.critic.parameters() if p.requires_grad],
                                               self.config.optim)
        self.lr_scheduler = optim.build_lr_scheduler(self.optimizer, self.config.optim)

    def _values(self, tensors: dict, kept: int) -> torch.Tensor:
        return self.critic(ModelInputs.responses(tensors, kept, self.packed, self.device))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """values [B, R], zero outside the response mask."""
        cfg = self.config
        batching.require_tokens("compute_values", data, ["responses", "response_mask"])
        self.critic.eval()
        micro = batching.micro_batch_indices(batching.row_lengths(data), cfg.forward_micro_batch_size_per_gpu,
                                         cfg.use_dynamic_bsz, cfg.forward_max_token_len_per_gpu, self.device)

        def forward(tensors, kept):
            with torch.no_grad():
                return (self._values(tensors, kept),)

        (values,) = batching.response_forward(data, micro, forward)
        return DataProto.from_dict({"values": values * data.batch["response_mask"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value loss (pyrl.ops.value_loss) against `returns`, the rollout's `values` as the old
        values; mini-batches, epochs and micro-batches as the actor, exact global means."""
        cfg = self.config
        batching.require_tokens("update_critic", data, ["responses", "response_mask", "values", "returns"])
        response_length = data.batch["responses"].shape[-1]
        plan = UpdatePlan("critic", cfg.ppo_mini_batch_size * self.rollout_n // self.world_size, cfg.ppo_epochs,
                          cfg.shuffle, cfg.data_loader_seed, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                          cfg.ppo_max_token_len_per_gpu, cfg.optim.clip_grad, cfg.loss_scale_factor or response_length,
                          hint=f" (critic.ppo_mini_batch_size={cfg.ppo_mini_batch_size} x rollout.n={self.rollout_n} "
                               f"/ {self.world_size} ranks)")

        def micro_step(mini: DataProto, idx: list, info: dict) -> dict:
            tensors, kept = batching.trimmed(mini.select_idxs(idx or [0]), response_length)
            values = self._values(tensors, kept)
            to = lambda key: tensors[key].to(self.device).float()  # noqa: E731
            mask = to("response_mask") * (1.0 if idx else 0.0)  # an empty micro-batch adds zero gradient
            loss, clipfrac = ops.value_loss(values, to("values"), to("returns"), mask, cfg.cliprange_value,
                                            cfg.loss_agg_mode, global_batch_info=info)
            loss.backward()
            share = float(mask.sum()) / max(info["response_tokens"], 1)
            return {"vf_loss": loss.item() / info["dp_size"], "vf_clipfrac": float(clipfrac) * share,
                    "vpred_mean": float(ops.masked_mean(values.detach(), mask)) * share}

        metrics = run_update(self.critic, self.optimizer, self.lr_scheduler, data, plan, cfg.fsdp, self.device,
                             self.world_size, self.value_model.config, self.compute_dtype, micro_step)
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        checkpoint.save_checkpoint(path, self.critic, self.optimizer, self.lr_scheduler, self.rank, None,
                                   self.value_model, "value_model.", self.tokenizer,
                                   "hf_model" in self.config.checkpoint.save_contents, self.peft_model,
                                   resolve_model_path(self.config.model.path))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        checkpoint.load_checkpoint(path, self.critic, self.optimizer, self.lr_scheduler, self.rank,
                                   trainable_only=self.peft_model is not None)
