"""Loading a worker's model and tokenizer from its model section (verl's model keys): one place for the actor's
causal LM, the critic's token classifier and the reward model's sequence classifier, with the same from_pretrained
keywords (float32 master weights, config overrides, packed attention) and gradient checkpointing."""

from __future__ import annotations

import torch

from pyrl.config import recomputes
from pyrl.models import embedding, gated_mlp, rms_norm, varlen_attention
from pyrl.models.hub import model_dir, resolve_model_path
from pyrl.workers.policy import ResponseLogProbs

__all__ = ["load_policy", "load_reward_classifier", "load_tokenizer", "load_value_model", "model_dir", "model_kwargs",
           "resolve_model_path"]


def load_tokenizer(model_config):
    """The model section's tokenizer (tokenizer_path, else path), with its custom_chat_template when set."""
    from transformers import AutoTokenizer  # lazy: transformers loads with the first model

    path = resolve_model_path(model_config.tokenizer_path or model_config.path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if model_config.custom_chat_template is not None:  # saved with the model too, as verl's HFModelConfig does:
        tokenizer.chat_template = model_config.custom_chat_template  # the export renders as training did
    return tokenizer


def model_kwargs(model_config) -> dict:
    """from_pretrained keywords for a worker's model: float32 master weights, the config overrides, and
    packed attention when model.use_remove_padding (see pyrl.models.varlen_attention)."""
    kwargs = {"dtype": torch.float32, "trust_remote_code": model_config.trust_remote_code}
    if model_config.use_remove_padding:
        kwargs["attn_implementation"] = varlen_attention.register()
    return kwargs


def _checkpointed(model, model_config):
    if recomputes(model_config):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _one_label_config(model_config):
    from transformers import AutoConfig  # lazy: transformers loads with the first model

    config = AutoConfig.from_pretrained(model_dir(model_config), trust_remote_code=model_config.trust_remote_code,
                                        **dict(model_config.override_config))
    config.num_labels = 1
    return config


def load_policy(model_config):
    """(HF causal LM, ResponseLogProbs over it); the worker shards it. model.use_fused_kernels: log-probs from the
    hidden states (pyrl.ops.fused_linear_logprobs), gated MLPs and RMSNorms that keep less for backward and run
    their elementwise work in fewer passes (pyrl.models.gated_mlp, pyrl.models.rms_norm), an input embedding whose
    gradient is added into .grad in place (pyrl.models.embedding)."""
    from transformers import AutoModelForCausalLM  # lazy: transformers loads with the first model

    lm = AutoModelForCausalLM.from_pretrained(model_dir(model_config), **model_kwargs(model_config),
                                              **dict(model_config.override_config))
    if model_config.use_fused_kernels:  # the same numbers to rounding, half the MLPs' activations kept for backward
        gated_mlp.patch_gated_mlps(lm)
        rms_norm.patch_rms_norms(lm)
        embedding.patch_embeddings(lm)
    return _checkpointed(lm, model_config), ResponseLogProbs(lm, model_config.use_fused_kernels)


def load_value_model(model_config):
    """The critic: a token classifier with one label (a value per token), no dropout in its head."""
    from transformers import AutoModelForTokenClassification  # lazy: transformers loads with the first model

    config = _one_label_config(model_config)
    config.classifier_dropout = 0.0  # HF's default 0.1 would make values noisy in training
    model = AutoModelForTokenClassification.from_pretrained(model_dir(model_config), config=config,
                                                            **model_kwargs(model_config))
    return _checkpointed(model, model_config)


def load_reward_classifier(model_config):
    """The reward model: a sequence classifier with one label (frozen: never checkpointed)."""
    from transformers import AutoModelForSequenceClassification  # lazy: transformers loads with the first model

    return AutoModelForSequenceClassification.from_pretrained(model_dir(model_config),
                                                              config=_one_label_config(model_config),
                                                              **model_kwargs(model_config))
