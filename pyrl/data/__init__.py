"""pyrl.data: verl-schema parquet datasets (RLHFDataset), a resumable seeded sampler, preprocessors for
GSM8K / MATH / Countdown, and the built-in toy task."""

from pyrl.data.dataset import PromptBatches, RLHFDataset, StatefulSampler, collate
from pyrl.data.toy import toy_task_files

__all__ = ["PromptBatches", "RLHFDataset", "StatefulSampler", "collate", "toy_task_files"]
