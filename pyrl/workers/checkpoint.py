"""Atomic checkpoints of an FSDP2 worker (torch.distributed.checkpoint, any world size on load), its LR
schedule and RNG, and Hugging Face export."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Iterable

import torch
from torch import nn

from pyrl.workers import lora
from pyrl.workers.distributed import barrier
from pyrl.workers.fsdp import full_state_items
from pyrl.workers.optim import restore_fused_step


def save_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int, extra: dict | None = None,
                    hf_model: nn.Module | None = None, strip_prefix: str = "", tokenizer=None,
                    hf_weights: bool = False, peft_model=None, base_model_path: str | None = None) -> None:
    """Sharded model + optimizer state through torch.distributed.checkpoint, and each rank's LR schedule,
    RNG states and `extra` beside it, written into PATH.tmp and renamed to PATH when every rank is done:
    a checkpoint directory is complete or absent.

    With `hf_model` (the HF model held in `model` under `strip_prefix`), PATH/huggingface as verl writes it: the
    config, generation config and `tokenizer` always (what `python -m pyrl.model_merger` needs beside the
    shards), and the whole weights too with `hf_weights` (save_contents has hf_model).

    With `peft_model` (LoRA, pyrl.workers.lora) only the trainable weights (the adapters) are saved, in the shards
    and as a PEFT adapter in PATH/lora_adapter (its base: `base_model_path`); hf_weights are merged."""
    # lazy: torch.distributed.checkpoint loads only to save or load a checkpoint (the driver imports this module)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    try:
        dcp.save(_checkpoint_state(model, optimizer, trainable_only=peft_model is not None)[0], checkpoint_id=tmp)
        extra = {**(extra or {}), "lr_scheduler": lr_scheduler.state_dict(), "rng": rng_state()}
        torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    except (Exception, CheckpointException) as e:  # torch reports a full disk as "unexpected pos": say so
        raise save_failed(tmp, e) from e
    if peft_model is not None:
        lora.save_adapter(os.path.join(tmp, lora.ADAPTER_DIR), peft_model, model, strip_prefix, rank, base_model_path)
    if hf_model is not None:
        items = None
        if hf_weights:
            items = (lora.merged_state_items if peft_model is not None else full_state_items)(model, strip_prefix)
        write_hf(os.path.join(tmp, "huggingface"), hf_model, tokenizer, rank, items)
    barrier()
    if rank == 0:
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def save_failed(path: str, error: Exception) -> OSError:
    """The error to raise when writing a checkpoint into PATH failed: it names the path, and says when the file
    system is full (torch's writers report that as "unexpected pos ...", losing the errno)."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC or free is not None and free < (1 << 20)
    reason = f"{os.strerror(errno.ENOSPC)} ({free} bytes free there)" if full else f"{type(error).__name__}: {error}"
    return OSError(errno.ENOSPC if full else getattr(error, "errno", None) or errno.EIO,
                   f"saving the checkpoint into {path} failed: {reason}; the last committed checkpoint is untouched")


def _checkpoint_state(model: nn.Module, optimizer, trainable_only: bool):
    """({"model": ..., "optimizer": ...} as torch.distributed.checkpoint saves them, their StateDictOptions);
    trainable_only leaves the frozen weights (LoRA's base model) out."""
    # lazy: torch.distributed.checkpoint loads only to save or load a checkpoint (the driver imports this module)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    if trainable_only:  # ignore_frozen_params keeps a frozen weight's tied alias (lm_head.weight = embed_tokens.weight)
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    return state, options


def load_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int,
                    trainable_only: bool = False) -> dict:
    """Restore what save_checkpoint wrote (any world size for the model and optimizer), the LR schedule and
    the RNG states; returns the rest of `extra`. trainable_only: a LoRA checkpoint (the adapters only)."""
    # lazy: torch.distributed.checkpoint loads only to save or load a checkpoint (the driver imports this module)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint {path!r}: not a directory written by save_checkpoint (no .metadata)")
    has_adapter = os.path.isdir(os.path.join(path, lora.ADAPTER_DIR))
    if has_adapter != trainable_only:
        raise ValueError(f"checkpoint {path!r}: {'a LoRA' if has_adapter else 'a whole-model'} checkpoint, but the "
                         "run is " + ("LoRA (model.lora_rank > 0)" if trainable_only else
                                      "whole-model (model.lora_rank=0)")
                         + ": resume with the model settings it was saved with")
    state, options = _checkpoint_state(model, optimizer, trainable_only)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}), options=options)
    if optimizer is not None:
        restore_fused_step(optimizer)
    extra_file = os.path.join(path, f"extra_rank{rank}.pt")
    extra = torch.load(extra_file, weights_only=False) if os.path.exists(extra_file) else {}
    if "lr_scheduler" in extra:
        lr_scheduler.load_state_dict(extra.pop("lr_scheduler"))
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return extra


def export_hf(path: str, hf_model: nn.Module, items: Iterable[tuple[str, torch.Tensor]], tokenizer, rank: int) -> None:
    """The whole model (`items`: every weight, named as hf_model names it, e.g. fsdp.full_state_items) as a Hugging
    Face directory (save_pretrained) at PATH, via PATH.tmp + rename."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    write_hf(tmp, hf_model, tokenizer, rank, items)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier()


def write_hf(directory: str, hf_model: nn.Module, tokenizer, rank: int,
             items: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Rank 0 writes `hf_model`'s config and generation config, and `tokenizer`, into DIRECTORY; with `items`
    (the whole weights, one gathered tensor at a time) the weights too, as save_pretrained lays them out. Every
    rank must call it: gathering the weights is a collective."""
    state = dict(items) if items is not None else None
    if rank != 0:
        return
    if state is not None:  # save_pretrained writes the config and generation config with the weights
        hf_model.save_pretrained(directory, state_dict={k: v.cpu() for k, v in state.items()})
    else:
        hf_model.config.save_pretrained(directory)
        if hf_model.can_generate():
            hf_model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

