"""Models pyrl makes itself (no model hub needed): the tiny Qwen2 + BPE tokenizer for tests and the default run;
and where a configured model path points (a local directory, pyrl's own models, a Hugging Face hub id)."""

from pyrl.models.hub import resolve_model_path
from pyrl.models.tiny import TinyModelSpec, make_tokenizer, tiny_model_path

__all__ = ["TinyModelSpec", "make_tokenizer", "resolve_model_path", "tiny_model_path"]
