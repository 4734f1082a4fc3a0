"""A tiny Qwen2 causal LM and a byte-level BPE tokenizer with a chat template, made offline and
deterministically from a seed, saved with save_pretrained so that HF and vLLM load them from a path.

Tests and the default run use it: no model hub is reachable. head_dim is 64 because vLLM's CPU
attention rejects smaller heads.
"""

from __future__ import annotations

import fcntl
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
# the tool-calling variant (TinyModelSpec(tools=True)): Qwen2.5's hermes layout, shortened for a tiny model (the
# system turn lists the tools by name only). A tool call is a JSON object between <tool_call> tags at the end of an
# assistant turn; tool results come back as a user turn of <tool_response> blocks (consecutive tool messages share
# one turn). Every turn ends with "<|im_end|>\n", so a conversation tokenized turn by turn (the assistant's tokens
# through its <|im_end|>, then "\n" and the next turn's rendering) equals the whole conversation tokenized at once.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool.function.name }}"
    "{% if not loop.last %} {% endif %}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>{{ message.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in (message.tool_calls or []) %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
    # the tool-calling variant: the tool task's texts in the BPE corpus, TOOL_TOKENS, TOOL_CHAT_TEMPLATE
    tools: bool = False

    def as_dict(self) -> dict:
        """The spec's fields; `tools` only when set, so that the specs made before it existed keep their
        fingerprints (cache directories) and pyrl_spec.json files."""
        fields = asdict(self)
        if not self.tools:
            del fields["tools"]
        return fields

    def fingerprint(self) -> str:
        """Names the cache directory: the spec plus FACTORY_VERSION (bumped when the factory changes)."""
        key = json.dumps({**self.as_dict(), "factory": FACTORY_VERSION}, sort_keys=True)
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


def _tool_corpus(seed: int, lines: int = 4000) -> list[str]:
    """The tool task's texts (pyrl.data.tool_calc), so that the scaffolding of a calculator call merges into few
    tokens: the pieces between the added tokens only (TOOL_TOKENS and ANSWER_TOKENS are whole tokens already)."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(lines):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        out.append(f'{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}')
        out.append(rng.choice(["system\n<tools>calculator</tools>", "user\n", "assistant\n", "tool"]))
    return out


def make_tokenizer(spec: TinyModelSpec = TinyModelSpec()):
    """Byte-level BPE (digits always single tokens) wrapped as a PreTrainedTokenizerFast with a chat
    template; <|im_end|> ends an assistant turn (eos), <|endoftext|> pads."""
    # lazy: tokenizers and transformers load only when the tiny model is made
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = _corpus(spec.seed) + (_tool_corpus(spec.seed) if spec.tools else [])
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    added = ANSWER_TOKENS + (TOOL_TOKENS if spec.tools else [])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None,
                                   padding_side="left")  # prompts are left-padded for generation, as verl does
    fast.chat_template = TOOL_CHAT_TEMPLATE if spec.tools else CHAT_TEMPLATE
    return fast


def make_model(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int):
    # lazy: torch and transformers load only when the tiny model is made
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


def tiny_classifier_path(spec: TinyModelSpec = TinyModelSpec(), cache_dir: str | None = None) -> str:
    """The tiny model's body with a one-label score head (seeded, untrained): a Qwen2ForSequenceClassification
    checkpoint with the same tokenizer, the served discriminative reward model of tests (pyrl.workers.reward_server);
    it scores nothing meaningfully. Made on first use, as tiny_model_path."""
    root = cache_dir or default_cache_dir()
    path = os.path.join(root, f"tiny-qwen2-{spec.fingerprint()}-classifier")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    source = tiny_model_path(spec, cache_dir)

    def write(tmp: str) -> None:
        # lazy: torch and transformers load only when the model is made
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
        torch.manual_seed(spec.seed)
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1,
                                                                   pad_token_id=tokenizer.pad_token_id)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    _write_once(root, path, write)
    return path


# The end-to-end benchmark's model (benchmarks/bench_e2e.py): ~24M parameters, large enough that a GRPO step on a
# 2-core CPU is dominated by the model's compute (generation, forward, backward), not by framework overhead.
BENCH_SPEC = TinyModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
                           intermediate_size=1536)
EOS_BIAS_VERSION = 1  # bumped when eos_biased_model_path's construction changes (names its cache directory)
EOS_CARRIER = 8.0  # the constant residual-stream value that carries the EOS logit (an embedding's others are ~0.02)


def default_cache_dir() -> str:
    return os.environ.get("PYRL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pyrl"))


def tiny_model_path(spec: TinyModelSpec = TinyModelSpec(), cache_dir: str | None = None) -> str:
    """Directory holding the tiny model and its tokenizer for `spec`, made on first use. Written to a
    temporary directory and renamed, so a crash never leaves a half-written model behind."""
    root = cache_dir or default_cache_dir()
    path = os.path.join(root, f"tiny-qwen2-{spec.fingerprint()}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path

    def write(tmp: str) -> None:
        tokenizer = make_tokenizer(spec)
        model = make_model(spec, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        with open(os.path.join(tmp, "pyrl_spec.json"), "w") as f:
            json.dump(spec.as_dict(), f, indent=1)

    _write_once(root, path, write)
    return path


def _write_once(root: str, path: str, write) -> None:
    """write(tmp) into a temporary directory under `root`, then rename it to `path`, so that a crash never
    leaves a half-written model behind. Concurrent makers (parallel test workers, two runs started at once) take
    turns under a file lock, and a later one finds the model made: a warm start is trained once, not per process.
    Without the lock (a file system that refuses it), the maker that renamed first wins."""
    os.makedirs(root, exist_ok=True)
    with open(path + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        if os.path.isfile(os.path.join(path, "config.json")):
            return
        _write_renamed(root, path, write)


def _write_renamed(root: str, path: str, write) -> None:
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-tiny-")
    try:
        write(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isfile(os.path.join(path, "config.json")):  # not a concurrent maker's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def eos_biased_model_path(spec: TinyModelSpec = BENCH_SPEC, eos_prob: float = 0.05,
                          cache_dir: str | None = None) -> str:
    """Directory holding the model of `spec` changed so that it emits EOS with probability about `eos_prob`
    at every position, whatever the context; made on first use, atomically, next to the base model.

    A randomly initialised model almost never samples EOS, so its responses all run to the length limit;
    benchmarks of responses that end at varied lengths need this variant: lengths are then geometric with
    mean ~1/eos_prob (cut at the response limit). A Qwen2 lm_head has no bias, which both HF and vLLM would
    load, so the bias is built from weights: residual-stream coordinate 0 is made a constant (EOS_CARRIER in
    every token's embedding; no attention or MLP writes it, and the layer norms give it zero weight, so
    no layer reads it), the final norm turns it into a near-constant input of lm_head, and only EOS's
    lm_head row reads it, with the weight that gives EOS the wanted probability against the other tokens'
    logits (calibrated on random prompts). Embeddings are untied first so that the EOS row can differ
    from the EOS embedding."""
    # lazy: torch and transformers load only when the tiny model is made
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 0 < eos_prob < 1:
        raise ValueError(f"eos_prob: expected a probability in (0, 1), got {eos_prob}")
    root = cache_dir or default_cache_dir()
    base = tiny_model_path(spec, root)
    key = json.dumps({"spec": spec.fingerprint(), "eos_prob": eos_prob, "version": EOS_BIAS_VERSION}, sort_keys=True)
    path = os.path.join(root, f"tiny-qwen2-eos-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.model.embed_tokens.weight[:, 0] = EOS_CARRIER
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos] = 0.0
        generator = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, len(tokenizer), (8, 64), generator=generator)
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        others = model.lm_head(hidden)
        others[..., eos] = float("-inf")
        # EOS's logit b gives probability e^b / (e^b + sum of the others' e^z): b = logit(p) + logsumexp(others)
        target = torch.logit(torch.tensor(eos_prob)) + torch.logsumexp(others, -1).mean()
        model.lm_head.weight[eos, 0] = target / hidden[..., 0].mean()

    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        with open(os.path.join(tmp, "pyrl_spec.json"), "w") as f:
            json.dump({**spec.as_dict(), "tie_word_embeddings": False, "eos_prob": eos_prob}, f, indent=1)

    _write_once(root, path, write)
    return path
