"""pyrl: reinforcement learning for language models, small and fast."""

__version__ = "0.1.0"
