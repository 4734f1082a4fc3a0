"""A tiny Qwen2 causal LM and a byte-level BPE tokenizer with a chat template, made offline and
deterministically from a seed, saved with save_pretrained so that HF and vLLM load them from a path.

Tests and the default run use it: no model hub is reachable. head_dim is 64 because vLLM's CPU
attention rejects smaller heads.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass

FACTORY_VERSION = 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# single tokens, but ordinary ones: decoding with skip_special_tokens=True (as reward managers do) keeps them
ANSWER_TOKENS = ["<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    vocab_size: int = 320  # the BPE target; the tokenizer may come out a little smaller
    tie_word_embeddings: bool = True

    def fingerprint(self) -> str:
        """Names the cache directory: the spec plus FACTORY_VERSION (bumped when the factory changes)."""
        key = json.dumps({**asdict(self), "factory": FACTORY_VERSION}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:12]


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Text the tokenizer learns from: arithmetic prompts and answers, and chat scaffolding words."""
    rng = random.Random(seed)
    words = ["what", "is", "the", "sum", "of", "answer", "compute", "number", "user", "assistant", "system",
             "please", "think", "step", "by", "and", "equals", "result", "add", "minus", "times", "target"]
    out = []
    for _ in range(lines):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append(f"{a:02d}+{b:02d}= <answer>{a + b}</answer>")
        out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(3, 9))) + rng.choice([".", "?", "!", ":"]))
    return out


def make_tokenizer(spec: TinyModelSpec = TinyModelSpec()):
    """Byte-level BPE (digits always single tokens) wrapped as a PreTrainedTokenizerFast with a chat
    template; <|im_end|> ends an assistant turn (eos), <|endoftext|> pads."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None,
                                   padding_side="left")  # prompts are left-padded for generation, as verl does
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        bos_token_id=None, torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config)


def default_cache_dir() -> str:
    return os.environ.get("PYRL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pyrl"))


def tiny_model_path(spec: TinyModelSpec = TinyModelSpec(), cache_dir: str | None = None) -> str:
    """Directory holding the tiny model and its tokenizer for `spec`, made on first use. Written to a
    temporary directory and renamed, so a crash never leaves a half-written model behind."""
    root = cache_dir or default_cache_dir()
    path = os.path.join(root, f"tiny-qwen2-{spec.fingerprint()}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-tiny-")
    try:
        tokenizer = make_tokenizer(spec)
        model = make_model(spec, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        with open(os.path.join(tmp, "pyrl_spec.json"), "w") as f:
            json.dump(asdict(spec), f, indent=1)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isfile(os.path.join(path, "config.json")):  # not a concurrent maker's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
