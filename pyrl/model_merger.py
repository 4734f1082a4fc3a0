"""Turn a pyrl checkpoint into a Hugging Face model directory, with verl's model merger command line:

    python -m pyrl.model_merger merge --backend fsdp --local_dir RUN/global_step_K/actor --target_dir OUT
    python -m pyrl.model_merger test --backend fsdp --local_dir RUN/global_step_K/actor --test_hf_dir HF_DIR

`merge` writes config.json, the weights (safetensors), the generation config and the tokenizer into OUT, which
transformers and vLLM load; `test` checks the checkpoint's weights against a Hugging Face model directory (as
verl's, e.g. the checkpoint's own huggingface/ saved with save_contents=[...,hf_model]). An actor's or a critic's
checkpoint (a causal LM or a token-classification value model). It runs in this one process on CPU: no Ray, no
torch.distributed; the shards of every rank are merged as torch.distributed.checkpoint loads them.

A LoRA checkpoint (model.lora_rank > 0) holds only the adapters: `merge` writes its base model with the adapters
merged in, and the adapter itself (PEFT's format) in OUT/lora_adapter. verl 0.9.1's merger writes the base weights
unmerged beside lora_adapter/, so its OUT is not the trained policy; pyrl's is.

Unlike verl, which casts the merged weights to bf16 (and its config.json says bfloat16), the weights keep the
checkpoint's dtype (pyrl's float32 master weights) and config.json says float32: the merged model is the trained
policy exactly; load it with dtype=torch.bfloat16 (vLLM: dtype="bfloat16") to run it in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings

import torch

from pyrl.workers.lora import ADAPTER_DIR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """verl 0.9.1's options (verl/model_merger/base_model_merger.py)."""
    parser = argparse.ArgumentParser(prog="python -m pyrl.model_merger", description="pyrl model merger")
    operations = parser.add_subparsers(dest="operation", required=True, help="merge or test")
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--backend", required=True, choices=["fsdp", "megatron"], help="pyrl saves fsdp checkpoints")
    base.add_argument("--local_dir", default=None, help="the checkpoint: RUN/global_step_<k>/actor (or critic)")
    base.add_argument("--tie-word-embedding", action="store_true", help="Megatron only in verl: ignored")
    base.add_argument("--trust-remote-code", action="store_true")
    base.add_argument("--is-value-model", action="store_true", help="Megatron only in verl: ignored (read from config)")
    base.add_argument("--use_cpu_initialization", action="store_true", help="Megatron only in verl: ignored")
    merge = operations.add_parser("merge", parents=[base], help="merge a checkpoint into a Hugging Face model")
    merge.add_argument("--target_dir", default="tmp", help="where to write the Hugging Face model")
    merge.add_argument("--hf_upload_path", default=None, help="a hub repository id to upload the model to")
    merge.add_argument("--private", action="store_true", help="upload to a private repository")
    test = operations.add_parser("test", parents=[base], help="compare a checkpoint with a Hugging Face model")
    test.add_argument("--test_hf_dir", required=True, help="the Hugging Face model directory to compare with")
    return parser.parse_args(argv)


def auto_model_class(config):
    """As verl's merger picks it: from the config's architecture."""
    # lazy: transformers loads only when a command runs
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    arch = (config.architectures or ["?"])[0]
    if "ForTokenClassification" in arch:
        return AutoModelForTokenClassification
    if "ForCausalLM" in arch:
        return AutoModelForCausalLM
    raise NotImplementedError(f"architecture {arch}: pyrl checkpoints hold causal LMs (actor) or token-classification "
                              "value models (critic)")


def load_merged_model(local_dir: str, trust_remote_code: bool = False):
    """The checkpoint's whole model as a transformers model on CPU, in the checkpoint's dtype."""
    from transformers import AutoConfig, GenerationConfig  # lazy: transformers loads only when a command runs

    if not local_dir or not os.path.isfile(os.path.join(local_dir, ".metadata")):
        raise FileNotFoundError(f"--local_dir {local_dir!r}: not a pyrl checkpoint (no .metadata); give a "
                                "RUN/global_step_<k>/actor or RUN/global_step_<k>/critic directory")
    hf_dir = os.path.join(local_dir, "huggingface")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"--local_dir {local_dir!r}: no huggingface/config.json beside the shards (the model "
                                "config a checkpoint saves; pyrl's older checkpoints lack it)")
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    if os.path.isdir(os.path.join(local_dir, ADAPTER_DIR)):
        model = merged_lora_model(local_dir, config, trust_remote_code)
    else:
        with torch.device("meta"):  # no memory until the checkpoint's tensors are assigned
            model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
        model.load_state_dict(checkpoint_state(local_dir, model.state_dict().keys()), strict=True, assign=True)
        model.tie_weights()
    if model.can_generate() and os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(hf_dir)  # the source model's, not the default
    return model.eval()


def merged_lora_model(local_dir: str, config, trust_remote_code: bool):
    """A LoRA checkpoint (its shards and lora_adapter/ hold the adapters only) merged into its base model, which
    adapter_config.json names (the model directory the run trained from: it must still be there)."""
    from peft import PeftModel  # lazy: peft loads only for a LoRA checkpoint

    adapter_dir = os.path.join(local_dir, ADAPTER_DIR)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base_path = json.load(f).get("base_model_name_or_path")
    if not base_path or not os.path.isfile(os.path.join(base_path, "config.json")):
        raise FileNotFoundError(f"--local_dir {local_dir!r} is a LoRA checkpoint whose base model {base_path!r} "
                                f"(base_model_name_or_path in {ADAPTER_DIR}/adapter_config.json) is not a model "
                                "directory here: put the base model there or edit that path")
    base = auto_model_class(config).from_pretrained(base_path, config=config, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def checkpoint_state(local_dir: str, expected) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint, every rank's shards merged, named as the HF model names its weights: the
    worker's wrapper prefix ("lm." for the actor, "value_model." for the critic) is found and dropped."""
    # lazy: torch.distributed.checkpoint loads only to read the shards
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "torch.distributed is uninitialized": a single process is what is meant
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys({"model"}, checkpoint_id=local_dir)["model"]
    expected = set(expected)
    name = next(iter(state))
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) + "." * (i > 0) for i in range(len(parts))]
    prefix = next((p for p in prefixes if name[len(p):] in expected), None)
    if prefix is None:
        raise ValueError(f"--local_dir {local_dir!r}: its weights ({name}, ...) do not match huggingface/config.json's "
                         "model")
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def merge(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer  # lazy: transformers loads only when a command runs

    model = load_merged_model(args.local_dir, args.trust_remote_code)
    os.makedirs(args.target_dir, exist_ok=True)
    model.save_pretrained(args.target_dir)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.local_dir, "huggingface"),
                                              trust_remote_code=args.trust_remote_code)
    tokenizer.save_pretrained(args.target_dir)
    if os.path.isdir(os.path.join(args.local_dir, ADAPTER_DIR)):  # the adapter too, as verl's merger writes it
        shutil.copytree(os.path.join(args.local_dir, ADAPTER_DIR), os.path.join(args.target_dir, ADAPTER_DIR),
                        dirs_exist_ok=True)
    print(f"saved the merged model to {os.path.abspath(args.target_dir)}")
    if args.hf_upload_path:
        from huggingface_hub import HfApi  # lazy: huggingface_hub loads only for --hf_upload_path

        api = HfApi()
        api.create_repo(args.hf_upload_path, private=args.private, exist_ok=True)
        api.upload_folder(folder_path=args.target_dir, repo_id=args.hf_upload_path, repo_type="model")
        print(f"uploaded it to {args.hf_upload_path}")


def test(args: argparse.Namespace) -> None:
    """verl's `test`: the same weight names, shapes and values (to 1e-6) as the model in --test_hf_dir."""
    model = load_merged_model(args.local_dir, args.trust_remote_code)
    reference = type(model).from_pretrained(args.test_hf_dir, dtype=model.dtype).state_dict()
    merged = model.state_dict()
    if merged.keys() != reference.keys():
        raise ValueError(f"weight names differ: missing {sorted(reference.keys() - merged.keys())}, extra "
                         f"{sorted(merged.keys() - reference.keys())}")
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    print(f"checks passed: {args.local_dir} matches {args.test_hf_dir}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.backend != "fsdp":
        sys.exit(f"--backend {args.backend}: pyrl saves FSDP checkpoints (torch.distributed.checkpoint); use fsdp")
    try:
        (merge if args.operation == "merge" else test)(args)
    except (FileNotFoundError, ValueError, NotImplementedError, AssertionError) as e:
        sys.exit(f"pyrl.model_merger: {e}")


if __name__ == "__main__":
    main()
