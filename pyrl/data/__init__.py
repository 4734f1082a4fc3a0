"""pyrl.data: verl-schema parquet datasets (RLHFDataset), a resumable seeded sampler, preprocessors for
GSM8K / MATH / Countdown, and the built-in toy and tool-use tasks."""

from pyrl.data.dataset import PromptBatches, RLHFDataset, StatefulSampler, collate
from pyrl.data.tool_calc import tool_calc_task_files
from pyrl.data.toy import toy_sft_task_files, toy_task_files

__all__ = ["PromptBatches", "RLHFDataset", "StatefulSampler", "collate", "tool_calc_task_files", "toy_sft_task_files",
           "toy_task_files"]
