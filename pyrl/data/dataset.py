"""RLHFDataset: parquet files in verl's schema (data_source, prompt as chat messages, ability,
reward_model {style, ground_truth}, extra_info, any other column), read with pyarrow, as verl 0.9.1's item
dicts; PromptBatches: any such dataset's prompts chat-templated and tokenized once at load, batched for
rollout. Problems name the file (or dataset), the row and what was expected."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.utils.data

from pyrl.protocol import DataProto, left_padded

log = logging.getLogger("pyrl")

TRUNCATIONS = ("error", "left", "right", "middle")


def _read_table(path: str):
    # lazy: pyarrow loads only when a data file is read
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from e


def sample_subset(count: int, max_samples: int, config) -> range | np.ndarray:
    """The rows, of `count`, that data.train_max_samples / val_max_samples keeps, as verl picks them: with
    config.shuffle a random subset seeded by config.seed (null: 0, where verl draws an unseeded one, which a resumed
    run would not see again), else the first ones; all of them for max_samples <= 0 or >= count."""
    if not 0 < max_samples < count:
        return range(count)
    if not config.shuffle:
        return range(max_samples)
    return np.random.default_rng(config.seed if config.seed is not None else 0).choice(count, max_samples,
                                                                                      replace=False)


def where(dataset, i: int) -> str:
    """Item i's place in error messages: the file and row when the dataset knows them."""
    return dataset.where(i) if hasattr(dataset, "where") else f"{type(dataset).__name__} item {i}"


def _plain(value):
    """numpy arrays (a list column read through pandas) as lists, at any depth."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check_messages(place: str, key: str, messages) -> list:
    """Chat messages as the chat template gets them, as verl 0.9.1's dataset hands them over: every field a message
    has (name, tool_calls, tool_call_id, reasoning_content, ...), less those parquet's struct columns fill with None
    where a message lacks them. content may be None on an assistant message that calls tools."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    messages = _plain(messages)
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
        for m in messages)
    if not ok:
        raise ValueError(f"{place}: column {key!r} must be a non-empty list of "
                         f"{{'role': str, 'content': str}} messages (or a string), got {messages!r:.200}")
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]


class RLHFDataset:
    """verl 0.9.1's RLHFDataset: the rows of parquet files as verl's item dicts. An item is the row with every
    column (so any extra column reaches the batch's non_tensor_batch, reward functions' extra_info and kwargs),
    the prompt column (data.prompt_key) turned into `raw_prompt` chat messages, and verl's `index` /
    `tools_kwargs` / `interaction_kwargs` from extra_info. Tokenizing is PromptBatches' job, as verl leaves it
    to its agent loop. The constructor is verl's, so a data.custom_cls written for verl is built the same way.
    """

    def __init__(self, data_files, tokenizer=None, config=None, processor=None, max_samples: int = -1):
        files = [data_files] if isinstance(data_files, str) else list(data_files)
        if not files:
            raise ValueError("data: no files given (data.train_files / data.val_files)")
        self.prompt_key, self.reward_fn_key = config.prompt_key, config.reward_fn_key
        self.rows: list[tuple[str, int, dict]] = []  # (file, row in the file, the row)
        for path in map(str, files):
            table = _read_table(path)
            if table.num_rows == 0:
                raise ValueError(f"data file {path!r} has no rows")
            for column in (self.prompt_key, self.reward_fn_key):
                if column not in table.column_names:
                    raise ValueError(f"data file {path!r}: missing column {column!r} (has {table.column_names}); "
                                     f"see data.prompt_key / data.reward_fn_key")
            self.rows += [(path, row, record) for row, record in enumerate(table.to_pylist())]
        self.rows = [self.rows[i] for i in sample_subset(len(self.rows), max_samples, config)]

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        """Item i's place, for error messages."""
        path, row, _ = self.rows[i]
        return f"data file {path!r} row {row}"

    def __getitem__(self, i: int) -> dict:
        item = dict(self.rows[i][2])
        messages = _check_messages(self.where(i), self.prompt_key, item.pop(self.prompt_key))
        if not isinstance(item[self.reward_fn_key], str):
            raise ValueError(f"{self.where(i)}: column {self.reward_fn_key!r} must be a string, "
                             f"got {item[self.reward_fn_key]!r:.100}")
        if not isinstance(item.get("reward_model") or {}, dict):
            raise ValueError(f"{self.where(i)}: column 'reward_model' must be a struct with "
                             f"'ground_truth', got {item['reward_model']!r:.100}")
        extra_info = item.get("extra_info") or {}
        return {**item, "raw_prompt": messages, "extra_info": extra_info, "index": extra_info.get("index", 0),
                "tools_kwargs": extra_info.get("tools_kwargs") or {},
                "interaction_kwargs": extra_info.get("interaction_kwargs") or {}}


class _Tokenized:
    """(item, prompt token ids) of a dataset's items: what the data-loader workers compute in parallel."""

    def __init__(self, dataset, tokenizer, data_config, chat_template, tools_for):
        self.dataset, self.tokenizer, self.cfg, self.chat_template = dataset, tokenizer, data_config, chat_template
        self.tools_for = tools_for

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[dict, list[int]]]:
        """The DataLoader's batched fetch: one tokenizer call for the batch's texts, the same ids as one call each
        (a fast tokenizer encodes them as one batch: 1.7 s -> 0.8-1.0 s for the toy task's 9,488 prompts here)."""
        items, texts = [], []
        for i in indices:
            item = self.dataset[i]
            if not isinstance(item, dict) or "raw_prompt" not in item:
                raise ValueError(f"data: item {i} of {type(self.dataset).__name__} must be a dict with 'raw_prompt' "
                                 f"(chat messages), as verl 0.9.1's RLHFDataset returns; got {str(item)[:200]}")
            messages = _check_messages(where(self.dataset, i), "raw_prompt", item["raw_prompt"])
            items.append(item)
            texts.append(self._text(messages, self.tools_for(item) if self.tools_for else None))
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return list(zip(items, ids))

    def _text(self, messages, tools) -> str:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.cfg.apply_chat_template and template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      chat_template=template, tools=tools,
                                                      **dict(self.cfg.apply_chat_template_kwargs))
        return "\n".join(m["content"] or "" for m in messages)


class PromptBatches:
    """A dataset's prompts, tokenized once at load (the chat template with data.apply_chat_template_kwargs, or
    actor_rollout_ref.model.custom_chat_template; `tools_for(item)` gives the OpenAI schemas of the tools the
    item's agent loop offers, for the template's tools=), truncated or filtered to data.max_prompt_length; `batch`
    gives verl's rollout input: left-padded prompts + every other item field as non_tensor_batch columns.
    data.dataloader_num_workers processes (at most one per core and per 64 items) read and tokenize the items
    (0: this process).
    """

    def __init__(self, dataset, tokenizer, data_config, chat_template: str | None = None, tools_for=None):
        self.max_prompt_length = data_config.max_prompt_length
        if data_config.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation: expected one of {TRUNCATIONS}, got {data_config.truncation!r}")
        tokenized = _Tokenized(dataset, tokenizer, data_config, chat_template, tools_for)
        if data_config.apply_chat_template and not (chat_template or getattr(tokenizer, "chat_template", None)):
            log.warning("data.apply_chat_template: the tokenizer has no chat template (and no "
                        "model.custom_chat_template is set): each prompt is its messages' contents joined by newlines")
        # no more processes than rows / 64 (a pool for a few rows costs more than it saves) or than this machine's cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(data_config.dataloader_num_workers, len(dataset) // 64, cores)
        if workers:  # the tokenizer's own threads do not survive the fork: say so once, not per worker
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        loader = torch.utils.data.DataLoader(tokenized, batch_size=64, num_workers=workers, collate_fn=list)
        self.dataset = dataset
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.source_items: list[int] = []  # each row's item of the dataset (rows skip the filtered ones)
        self.filtered = 0
        for i, (item, ids) in enumerate(pair for chunk in loader for pair in chunk):
            if len(ids) > self.max_prompt_length:
                if data_config.filter_overlong_prompts:
                    self.filtered += 1
                    continue
                ids = self._truncate(ids, data_config.truncation, where(dataset, i))
            self.rows.append(_non_tensor_fields(item, i))
            self.prompt_ids.append(ids)
            self.source_items.append(i)
        if not self.rows:
            raise ValueError(f"data: no usable rows in {type(dataset).__name__} (filtered as overlong: "
                             f"{self.filtered})")

    def place(self, row: int) -> str:
        """Row `row`'s place in error messages: its file and row there, where the dataset knows them."""
        return where(self.dataset, self.source_items[row])

    def _truncate(self, ids, mode, place: str):
        limit = self.max_prompt_length
        if mode == "error":
            raise ValueError(f"{place}: the prompt has {len(ids)} tokens, over "
                             f"data.max_prompt_length={limit} (set data.truncation=left|right|middle or "
                             f"data.filter_overlong_prompts=true)")
        if mode == "left":
            return ids[-limit:]
        if mode == "right":
            return ids[:limit]
        return ids[:limit // 2] + ids[len(ids) - (limit - limit // 2):]

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices, pad_token_id: int) -> DataProto:
        return collate([self.prompt_ids[i] for i in indices], [self.rows[i] for i in indices], self.max_prompt_length,
                       pad_token_id)


# verl's placeholder so that its DataProto.batch is never empty; pyrl's batch always holds the prompts
VERL_PLACEHOLDERS = ("dummy_tensor",)


def _non_tensor_fields(item: dict, row: int) -> dict:
    """An item's per-sample fields; raw_prompt (the prompt's messages) always, as verl 0.9.1's dataset keeps it
    whatever data.return_raw_chat says."""
    fields = {}
    for key, value in item.items():
        if key in VERL_PLACEHOLDERS:
            continue
        if isinstance(value, torch.Tensor):
            raise ValueError(f"data: item {row} field {key!r} is a tensor; pyrl tokenizes raw_prompt itself and takes "
                             f"only per-sample values (numbers, strings, dicts, lists) from items")
        fields[key] = value
    return fields


def collate(prompt_ids, rows, width: int, pad_token_id: int) -> DataProto:
    """Prompts left-padded to `width` (verl pads to max_prompt_length) + the rows' other fields as numpy
    object columns (a field some rows lack is None there)."""
    input_ids, attention_mask = left_padded(prompt_ids, pad_token_id, width)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    keys = list(dict.fromkeys(key for r in rows for key in r))
    non_tensors = {key: np.array([r.get(key) for r in rows] + [None], dtype=object)[:-1] for key in keys}
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                               non_tensors=non_tensors)


class StatefulSampler:
    """Batches of indices, reshuffled each epoch from (seed, epoch), dropping the last partial batch; its
    state (seed, epoch, position) goes into checkpoints so a resumed run continues with the same batches.
    seed None (verl's data.seed default): 0, so every run draws the same order, as verl 0.9.1's sampler does with
    its unseeded torch.Generator (whose initial seed is a constant)."""

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int | None = None,
                 key: str = "data.train_batch_size"):
        if batch_size > size:
            raise ValueError(f"{key}={batch_size} is larger than the data set ({size} rows)")
        if seed is None:
            seed = 0
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size)

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state.get("seed", self.seed))
