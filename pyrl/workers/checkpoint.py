"""Atomic checkpoints of an FSDP2 worker (torch.distributed.checkpoint, any world size on load), its LR
schedule and RNG, and Hugging Face export."""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from pyrl.workers.distributed import barrier
from pyrl.workers.fsdp import full_state_items


def save_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int, extra: dict | None = None,
                    hf_model: nn.Module | None = None, strip_prefix: str = "", tokenizer=None,
                    hf_weights: bool = False) -> None:
    """Sharded model + optimizer state through torch.distributed.checkpoint, and each rank's LR schedule,
    RNG states and `extra` beside it, written into PATH.tmp and renamed to PATH when every rank is done:
    a checkpoint directory is complete or absent.

    With `hf_model` (the HF model held in `model` under `strip_prefix`), PATH/huggingface as verl writes it: the
    config, generation config and `tokenizer` always (what `python -m pyrl.model_merger` needs beside the
    shards), and the whole weights too with `hf_weights` (save_contents has hf_model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.save(state, checkpoint_id=tmp)
    extra = {**(extra or {}), "lr_scheduler": lr_scheduler.state_dict(), "rng": rng_state()}
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    if hf_model is not None:
        write_hf(os.path.join(tmp, "huggingface"), hf_model, tokenizer, rank, model if hf_weights else None,
                 strip_prefix)
    barrier()
    if rank == 0:
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int) -> dict:
    """Restore what save_checkpoint wrote (any world size for the model and optimizer), the LR schedule and
    the RNG states; returns the rest of `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint {path!r}: not a directory written by save_checkpoint (no .metadata)")
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    extra_file = os.path.join(path, f"extra_rank{rank}.pt")
    extra = torch.load(extra_file, weights_only=False) if os.path.exists(extra_file) else {}
    if "lr_scheduler" in extra:
        lr_scheduler.load_state_dict(extra.pop("lr_scheduler"))
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return extra


def export_hf(path: str, hf_model: nn.Module, wrapped: nn.Module, strip_prefix: str, tokenizer, rank: int) -> None:
    """The whole model as a Hugging Face directory (save_pretrained) at PATH, via PATH.tmp + rename."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    write_hf(tmp, hf_model, tokenizer, rank, wrapped, strip_prefix)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier()


def write_hf(directory: str, hf_model: nn.Module, tokenizer, rank: int, wrapped: nn.Module | None = None,
             strip_prefix: str = "") -> None:
    """Rank 0 writes `hf_model`'s config and generation config, and `tokenizer`, into DIRECTORY; with `wrapped`
    (the FSDP module holding hf_model under `strip_prefix`) the whole weights too, as save_pretrained lays them
    out. Every rank must call it: gathering the weights is a collective."""
    state = dict(full_state_items(wrapped, strip_prefix)) if wrapped is not None else None
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

