"""LoRA through PEFT, with verl's keys (model.lora_rank, lora_alpha, target_modules, exclude_modules,
lora_adapter_path), for the actor and the critic under FSDP2.

    W' = W + (alpha / r) * B @ A        A: [r, in], B: [out, r] (B starts at zero: W' = W at step 0)

PEFT injects the adapters into the HF model in place (its decoder layers stay where the FSDP wrapping finds them)
and freezes everything else, so only A and B (and, for the critic, its new value head) train, take optimizer
state and go into checkpoints. The reference policy is the same model with the adapters switched off
(`adapters_disabled`): no second copy of the weights. The rollout engine gets W' merged here, one tensor at a time
(`merged_state_items`): vLLM then runs a plain model at full speed, with no LoRA kernels and no adapter
bookkeeping (benchmarks/lora_sync.py measures this against vLLM's adapter loading; RESULTS.md, "LoRA").
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch
from torch import nn

from pyrl.verl_features import Unsupported
from pyrl.workers.distributed import full_tensor

log = logging.getLogger("pyrl")
ADAPTER = "default"  # PEFT's name for the one adapter
VALUE_HEADS = ["score", "classifier"]  # a token-classification model's head: PEFT's TOKEN_CLS modules_to_save
ADAPTER_DIR = "lora_adapter"  # a checkpoint's adapter in PEFT's format (verl's merger writes the same name)


def uses_lora(model_config) -> bool:
    return model_config.lora_rank > 0


def check_lora_config(model_config, key: str, task_type: str) -> None:
    """The LoRA keys of `key` (e.g. actor_rollout_ref.model) hold values PEFT can use; raised at start."""
    if model_config.lora_rank < 0:
        raise ValueError(f"{key}.lora_rank: expected >= 0 (0 trains the whole model), got {model_config.lora_rank}")
    if not uses_lora(model_config):
        if model_config.lora_adapter_path:  # verl 0.9.1 trains the whole model then, its adapter ignored
            raise Unsupported(f"{key}.lora_adapter_path is set but {key}.lora_rank is 0: set lora_rank > 0 (the "
                              "adapter's rank) to train it")
        return
    if model_config.lora_alpha <= 0:
        raise ValueError(f"{key}.lora_alpha: expected > 0, got {model_config.lora_alpha}")
    path = model_config.lora_adapter_path
    if path and not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise FileNotFoundError(f"{key}.lora_adapter_path: {path!r} is not a PEFT adapter directory (no "
                                "adapter_config.json)")
    if path:
        check_adapter_task(model_config, task_type, key)
        loaded = adapter_config(model_config, task_type)
        log.info("%s.lora_adapter_path: its adapter_config.json sets rank %d, alpha %s, targets %s; %s.lora_rank, "
                 "lora_alpha, target_modules and exclude_modules are not used", key, loaded.r, loaded.lora_alpha,
                 sorted(loaded.target_modules) if isinstance(loaded.target_modules, set) else loaded.target_modules,
                 key)


def adapter_config(model_config, task_type: str):
    """The LoraConfig a model gets: model.lora_adapter_path's adapter_config.json (its rank, alpha and targets
    rule, as in verl), else rank / alpha / target and excluded modules. task_type CAUSAL_LM (the actor) or
    TOKEN_CLS (the critic: its value head trains whole, as PEFT's modules_to_save, and takes no adapter)."""
    from peft import LoraConfig, TaskType  # lazy: peft loads only for LoRA

    if model_config.lora_adapter_path:
        loaded = LoraConfig.from_pretrained(model_config.lora_adapter_path)
        if loaded.task_type is None and task_type == "CAUSAL_LM":  # no task saved: an actor's, as verl loads it
            loaded.task_type = TaskType.CAUSAL_LM
        return loaded
    exclude = _plain(model_config.exclude_modules)
    if task_type == "TOKEN_CLS":
        exclude = (VALUE_HEADS if exclude is None else exclude + VALUE_HEADS if isinstance(exclude, list)
                   else f"(?:{exclude})|(?:{'|'.join(VALUE_HEADS)})")
    return LoraConfig(task_type=TaskType[task_type], r=model_config.lora_rank, lora_alpha=model_config.lora_alpha,
                      target_modules=_plain(model_config.target_modules), exclude_modules=exclude, bias="none")


def add_adapters(model: nn.Module, model_config, task_type: str, key: str):
    """PEFT's LoRA injected into `model` in place (verl's _build_lora_module): model.lora_adapter_path's weights
    (trainable), else fresh adapters of adapter_config(). Returns the PeftModel (for adapters_disabled and the
    adapter's config); `model` itself keeps its structure. `key` names the config section in errors."""
    from peft import PeftModel, get_peft_model  # lazy: peft loads only for LoRA

    if model_config.lora_adapter_path:
        check_adapter_task(model_config, task_type, key)
        peft_model = PeftModel.from_pretrained(model, model_config.lora_adapter_path, is_trainable=True,
                                               config=adapter_config(model_config, task_type))
    else:
        peft_model = get_peft_model(model, adapter_config(model_config, task_type))
    check_adapted(model, task_type, key)
    return peft_model


def check_adapter_task(model_config, task_type: str, key: str) -> None:
    """model.lora_adapter_path's adapter was saved for this kind of model: an actor's (CAUSAL_LM) adapter has no
    value head to train, a critic's (TOKEN_CLS) one carries a head the actor does not have. An adapter saved
    without a task_type is taken as an actor's (adapter_config), as verl 0.9.1 takes it."""
    saved = adapter_config(model_config, task_type).task_type
    saved = getattr(saved, "value", saved)
    if saved != task_type:
        raise ValueError(f"{key}.lora_adapter_path: the adapter was saved with task_type {saved}, expected {task_type}"
                         " (" + ("the critic: a pyrl critic checkpoint" if task_type == "TOKEN_CLS"
                                 else "the actor: a pyrl actor checkpoint")
                         + "'s lora_adapter)")


def check_adapted(model: nn.Module, task_type: str, key: str) -> None:
    """What pyrl can train and push: adapters on linear layers only, never on the output head, and for the critic
    a trainable value head (an actor's adapter loaded into a critic would leave its new head random and frozen)."""
    # lazy: peft loads only for LoRA
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    unsupported = sorted({type(m).__name__ for m in model.modules() if isinstance(m, LoraLayer)
                          and not isinstance(m, LoraLinear)})
    if unsupported:  # the merged push handles Linear's W + s * B @ A only
        raise ValueError(f"{key}.target_modules: LoRA on {', '.join(unsupported)} layers is not supported (pyrl "
                         "merges adapters of linear layers); target linear layers only, e.g. all-linear")
    if isinstance(model.get_output_embeddings(), LoraLayer):  # the fused log-prob kernel reads the head's weight
        raise ValueError(f"{key}.target_modules: LoRA on the output head (lm_head) is not supported; all-linear "
                         "leaves it out")
    if task_type == "TOKEN_CLS" and not any(p.requires_grad for name, p in model.named_parameters()
                                            if name.split(".")[0] in VALUE_HEADS):
        raise ValueError(f"{key}.lora_adapter_path: the adapter leaves the critic's value head frozen (an adapter "
                         "saved with task_type TOKEN_CLS, such as a pyrl critic checkpoint's lora_adapter, trains it)")


def _plain(value):
    """OmegaConf lists -> lists, for PEFT's type checks."""
    return list(value) if value is not None and not isinstance(value, str) else value


def adapters_disabled(peft_model) -> contextlib.AbstractContextManager:
    """The base model: every adapter off for the block (the reference policy's log-probs)."""
    return peft_model.disable_adapter()


def lora_layers(root: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer  # lazy: peft loads only for LoRA

    return {name: module for name, module in root.named_modules() if isinstance(module, LoraLayer)}


def merged_state_items(root: nn.Module, strip_prefix: str = "", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of the model with every adapter merged in, named as the plain HF model names them
    (q_proj.base_layer.weight -> q_proj.weight), one tensor at a time as fsdp.full_state_items; every rank must
    iterate it to the end (each gather is a collective). The merge runs in float32."""
    layers = lora_layers(root)
    for name, tensor in root.state_dict().items():
        # lora_A / lora_B are merged into their layer's weight below; a trained copy (PEFT's modules_to_save, the
        # critic's value head) stands in for its original
        if ".lora_" in name or ".original_module." in name:
            continue
        name = name.replace(f".modules_to_save.{ADAPTER}.", ".")
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        whole = full_tensor(tensor.detach())
        if owner.endswith(".base_layer") and layer_name in layers:
            name = f"{layer_name}.{leaf}"
            if leaf == "weight":
                whole = whole.float() + delta_weight(layers[layer_name]).to(whole.device)
        if dtype is not None:
            whole = whole.to(dtype)
        yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, whole


def delta_weight(layer) -> torch.Tensor:
    """scaling * B @ A [out, in] of one LoRA linear layer, its sharded A and B gathered (collectives)."""
    a = full_tensor(layer.lora_A[ADAPTER].weight.detach()).float()
    b = full_tensor(layer.lora_B[ADAPTER].weight.detach()).float()
    delta = (b @ a) * layer.scaling[ADAPTER]
    return delta.t() if layer.fan_in_fan_out else delta


def trainable_state_items(root: nn.Module, strip_prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of the trainable parameters only (the adapters), in the same order on every rank."""
    for name, param in root.named_parameters():
        if param.requires_grad:
            yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, full_tensor(param.detach())


def save_adapter(directory: str, peft_model, root: nn.Module, strip_prefix: str, rank: int,
                 base_model_path: str) -> None:
    """The adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) in DIRECTORY, which
    PeftModel.from_pretrained, vLLM's LoRA loading and model.lora_adapter_path read. Every rank must call it
    (the gathers are collectives); rank 0 writes."""
    state = {f"base_model.model.{name}": tensor.cpu() for name, tensor in trainable_state_items(root, strip_prefix)}
    if rank != 0:
        return
    peft_model.peft_config[ADAPTER].base_model_name_or_path = base_model_path
    peft_model.save_pretrained(directory, state_dict=state)
