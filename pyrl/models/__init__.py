"""Models pyrl makes itself (no model hub needed): the tiny Qwen2 + BPE tokenizer for tests and the default run."""

from pyrl.models.tiny import TinyModelSpec, make_tokenizer, tiny_model_path

__all__ = ["TinyModelSpec", "make_tokenizer", "tiny_model_path"]
