"""The reward-model worker: an HF sequence classifier (1 label) on FSDP2 that scores each prompt +
response at its last valid token; the score goes on the last response token (`rm_scores` [B, R]).

When the reward model has its own tokenizer (reward_model.model.tokenizer_path or a different
vocabulary), each prompt + response is decoded with the policy's tokenizer and encoded with the
reward model's."""

from __future__ import annotations

import torch
from torch import nn

from pyrl.controller import Dispatch, Worker, register
from pyrl.protocol import DataProto, PackedTensor, response_lengths
from pyrl.workers import batching, fsdp
from pyrl.workers.batching import ModelInputs
from pyrl.workers.distributed import worker_device
from pyrl.workers.models import load_reward_classifier, load_tokenizer, resolve_model_path


class LastTokenScore(nn.Module):
    """The classifier's score at each row's last attended token -> [rows] (FSDP2 root module)."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    @property
    def body(self) -> nn.Module:  # a property: registering the module twice would list its weights twice
        return getattr(self.classifier, self.classifier.base_model_prefix)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        hidden = inputs.hidden_states(self.body)
        return inputs.scatter(self.classifier.score(inputs.scored_states(hidden)).float())[:, 0, 0]


class RewardModelWorker(Worker):
    def __init__(self, config, policy_tokenizer_path: str = ""):
        super().__init__()
        self.config = config
        self.policy_tokenizer_path = policy_tokenizer_path
        self.device = worker_device(self.local_rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoTokenizer  # lazy: transformers loads with the model

        torch.manual_seed(0)  # a score head the checkpoint lacks starts equal on every rank

        model_cfg = self.config.model
        self.scorer = LastTokenScore(load_reward_classifier(model_cfg))
        fsdp.fsdp_wrap(self.scorer, self.scorer.body.layers, self.config.fsdp_config, self.device)
        self.scorer.requires_grad_(False).eval()
        self.rm_tokenizer = load_tokenizer(model_cfg)
        self.policy_tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.policy_tokenizer_path))
        self.retokenize = self.rm_tokenizer.get_vocab() != self.policy_tokenizer.get_vocab()

    def _inputs(self, data: DataProto):
        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        if not self.retokenize:
            return ids, mask, data.batch["position_ids"]
        texts = [self.policy_tokenizer.decode(row[m.bool()]) for row, m in zip(ids, mask)]
        self.rm_tokenizer.padding_side = "right"
        enc = self.rm_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return enc["input_ids"], enc["attention_mask"], positions

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        cfg = self.config
        batching.require_tokens("compute_rm_score", data, ["response_mask"])
        if isinstance(data.batch["input_ids"], PackedTensor):  # retokenizing works on the padded view
            data = data.to_padded()
        ids, mask, positions = self._inputs(data)
        scores = torch.zeros(len(data), dtype=torch.float32)
        for idx in batching.micro_batch_indices(mask.sum(-1), cfg.micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                                cfg.forward_max_token_len_per_gpu, self.device):
            rows = idx or [0]
            out = self.scorer(ModelInputs.last_tokens(ids[rows], mask[rows], positions[rows],
                                                      cfg.model.use_remove_padding, self.device))
            if idx:
                scores[idx] = out.cpu()
        lengths = response_lengths(data)  # the last attended token (a multi-turn response's mask has holes)
        rm_scores = torch.zeros(data.batch["response_mask"].shape, dtype=torch.float32)
        rm_scores[torch.arange(len(data)), (lengths - 1).clamp(min=0)] = scores * (lengths > 0)
        return DataProto.from_dict({"rm_scores": rm_scores})
