"""The critic worker: the LM body with a scalar value head (HF token classification, 1 label) on FSDP2.
The value of response token t is the head's output on the state before it (columns [P-1, P+R-1))."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pyrl import ops
from pyrl.controller import Dispatch, Worker, register
from pyrl.protocol import DataProto
from pyrl.workers import fsdp
from pyrl.workers.actor import LOG_PROB_KEYS, load_tokenizer, require_keys, resolve_model_path


class ResponseValues(nn.Module):
    """input_ids [B, P + R] -> values [B, R] of the response positions (FSDP2 root module)."""

    def __init__(self, value_model: nn.Module):
        super().__init__()
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, position_ids, response_length: int):
        total = input_ids.shape[1]
        out = self.value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        # a copy, not a view of the logits: FSDP2 hooks its backward on the root's output, and an in-place
        # op on a view would skip that hook
        return out.logits[:, total - response_length - 1:total - 1, 0].to(torch.float32, copy=True)


def load_value_model(model_config, device):
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = resolve_model_path(model_config.path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code,
                                        **dict(model_config.override_config))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # HF's default 0.1 would make values noisy in training
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                            trust_remote_code=model_config.trust_remote_code)
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class CriticWorker(Worker):
    def __init__(self, config, rollout_n: int = 1):
        super().__init__()
        self.config, self.rollout_n = config, rollout_n
        self.device = fsdp.worker_device(self.local_rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.config.data_loader_seed)  # the new value head starts equal on every rank
        self.tokenizer = load_tokenizer(self.config.model)
        self.value_model = load_value_model(self.config.model, self.device)
        torch.manual_seed(self.config.data_loader_seed + self.rank)
        self.critic = ResponseValues(self.value_model)
        fsdp.fsdp_wrap(self.critic, self.value_model.model.layers, self.config.fsdp_config, self.device)
        self.optimizer = fsdp.build_optimizer(self.critic.parameters(), self.config.optim)
        self.lr_scheduler = fsdp.build_lr_scheduler(self.optimizer, self.config.optim)

    def _values(self, tensors: dict, kept: int) -> torch.Tensor:
        return self.critic(tensors["input_ids"].to(self.device), tensors["attention_mask"].to(self.device),
                           tensors["position_ids"].to(self.device), kept)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """values [B, R], zero outside the response mask."""
        cfg = self.config
        require_keys("compute_values", data, LOG_PROB_KEYS + ["response_mask"])
        self.critic.eval()
        micro = fsdp.micro_batch_indices(data.batch["attention_mask"].sum(-1), cfg.forward_micro_batch_size_per_gpu,
                                         cfg.use_dynamic_bsz, cfg.forward_max_token_len_per_gpu, self.device)

        def forward(tensors, kept):
            with torch.no_grad():
                return (self._values(tensors, kept),)

        (values,) = fsdp.response_forward(data, micro, forward)
        return DataProto.from_dict({"values": values * data.batch["response_mask"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value loss (pyrl.ops.value_loss) against `returns`, the rollout's `values` as the old
        values; mini-batches, epochs and micro-batches as the actor, exact global means."""
        cfg = self.config
        require_keys("update_critic", data, LOG_PROB_KEYS + ["response_mask", "values", "returns"])
        response_length = data.batch["responses"].shape[-1]
        history: dict[str, list] = {}
        self.critic.train()
        mini_batch = cfg.ppo_mini_batch_size * self.rollout_n // self.world_size
        with fsdp.optimizer_state_on(self.optimizer, self.device, cfg.fsdp_config):
            for mini in fsdp.mini_batches(data, mini_batch, cfg.ppo_epochs, cfg.shuffle, cfg.data_loader_seed,
                                          "update_critic"):
                info = fsdp.global_batch_info(mini.batch["response_mask"], self.device, self.world_size)
                sums = torch.zeros(3, dtype=torch.float64)  # vf_loss, vf_clipfrac, vpred_mean
                self.optimizer.zero_grad(set_to_none=True)
                for idx in fsdp.micro_batch_indices(mini.batch["attention_mask"].sum(-1), cfg.ppo_micro_batch_size_per_gpu,
                                                    cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, self.device):
                    tensors, kept = fsdp.trimmed(mini.select_idxs(idx or [0]), response_length)
                    values = self._values(tensors, kept)
                    to = lambda key: tensors[key].to(self.device).float()  # noqa: E731
                    mb_mask = to("response_mask") * (1.0 if idx else 0.0)  # an empty micro-batch adds zero gradient
                    loss, clipfrac = ops.value_loss(values, to("values"), to("returns"), mb_mask, cfg.cliprange_value,
                                                    cfg.loss_agg_mode, global_batch_info=info)
                    loss.backward()
                    share = float(mb_mask.sum()) / max(info["batch_num_tokens"], 1)
                    sums += torch.tensor([loss.item(), float(clipfrac) * share,
                                          float(ops.masked_mean(values.detach(), mb_mask)) * share], dtype=torch.float64)
                grad_norm = fsdp.optimizer_step(self.critic, self.optimizer, cfg.grad_clip)
                sums = fsdp.all_reduce(sums.to(self.device)).cpu()
                sums[0] /= self.world_size
                for name, value in zip(("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"), sums.tolist()):
                    history.setdefault(name, []).append(value)
                history.setdefault("critic/grad_norm", []).append(grad_norm)
        history["critic/lr"] = [self.lr_scheduler.get_last_lr()[0]]
        self.lr_scheduler.step()
        return DataProto(meta_info={"metrics": {k: float(np.mean(v)) for k, v in history.items()}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        fsdp.save_checkpoint(path, self.critic, self.optimizer, self.lr_scheduler, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        fsdp.load_checkpoint(path, self.critic, self.optimizer, self.lr_scheduler, self.rank)
