"""RLHFDataset: parquet files in verl's schema (data_source, prompt as chat messages, ability,
reward_model {style, ground_truth}, extra_info), read with pyarrow, chat-templated and tokenized once
at load. Problems name the file, the row and what was expected."""

from __future__ import annotations

import os

import numpy as np

from pyrl.protocol import DataProto, left_padded

TRUNCATIONS = ("error", "left", "right", "middle")


def _read_table(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from e


def _check_messages(path: str, row: int, key: str, messages) -> list:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ValueError(f"data file {path!r} row {row}: column {key!r} must be a non-empty list of "
                         f"{{'role': str, 'content': str}} messages (or a string), got {messages!r:.200}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class RLHFDataset:
    def __init__(self, files, tokenizer, data_config, max_rows: int | None = None):
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise ValueError("data: no files given (data.train_files / data.val_files)")
        self.tokenizer = tokenizer
        self.max_prompt_length = data_config.max_prompt_length
        self.prompt_key, self.reward_fn_key = data_config.prompt_key, data_config.reward_fn_key
        if data_config.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation: expected one of {TRUNCATIONS}, got {data_config.truncation!r}")
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.filtered = 0
        for path in files:
            self._load(str(path), data_config)
        if max_rows is not None:
            self.rows, self.prompt_ids = self.rows[:max_rows], self.prompt_ids[:max_rows]
        if not self.rows:
            raise ValueError(f"data: no usable rows in {files} (filtered as overlong: {self.filtered})")

    def _load(self, path: str, cfg) -> None:
        table = _read_table(path)
        if table.num_rows == 0:
            raise ValueError(f"data file {path!r} has no rows")
        for column in (self.prompt_key, self.reward_fn_key):
            if column not in table.column_names:
                raise ValueError(f"data file {path!r}: missing column {column!r} (has {table.column_names}); "
                                 f"see data.prompt_key / data.reward_fn_key")
        for row, record in enumerate(table.to_pylist()):
            messages = _check_messages(path, row, self.prompt_key, record[self.prompt_key])
            if not isinstance(record[self.reward_fn_key], str):
                raise ValueError(f"data file {path!r} row {row}: column {self.reward_fn_key!r} must be a string, "
                                 f"got {record[self.reward_fn_key]!r:.100}")
            reward_model = record.get("reward_model") or {}
            if not isinstance(reward_model, dict):
                raise ValueError(f"data file {path!r} row {row}: column 'reward_model' must be a struct with "
                                 f"'ground_truth', got {reward_model!r:.100}")
            ids = self._tokenize(messages, cfg)
            if len(ids) > self.max_prompt_length:
                if cfg.filter_overlong_prompts:
                    self.filtered += 1
                    continue
                ids = self._truncate(ids, cfg.truncation, path, row)
            self.rows.append({"data_source": record[self.reward_fn_key], "reward_model": reward_model,
                              "extra_info": record.get("extra_info") or {}, "raw_prompt": messages,
                              "ability": record.get("ability")})
            self.prompt_ids.append(ids)

    def _tokenize(self, messages, cfg) -> list[int]:
        if cfg.apply_chat_template and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _truncate(self, ids, mode, path, row):
        limit = self.max_prompt_length
        if mode == "error":
            raise ValueError(f"data file {path!r} row {row}: the prompt has {len(ids)} tokens, over "
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
        return collate([self.prompt_ids[i] for i in indices], [self.rows[i] for i in indices], indices,
                       self.max_prompt_length, pad_token_id)


def collate(prompt_ids, rows, indices, width: int, pad_token_id: int) -> DataProto:
    """Prompts left-padded to `width` (verl pads to max_prompt_length) + the rows' other fields as numpy
    object columns."""
    input_ids, attention_mask = left_padded(prompt_ids, pad_token_id, width)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    non_tensors = {key: np.array([r[key] for r in rows] + [None], dtype=object)[:-1] for key in rows[0]}
    non_tensors["index"] = np.asarray(indices, dtype=np.int64)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                               non_tensors=non_tensors)


class StatefulSampler:
    """Batches of indices, reshuffled each epoch from (seed, epoch), dropping the last partial batch; its
    state (epoch, position) goes into checkpoints so a resumed run continues with the same batches."""

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int = 1):
        if batch_size > size:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the data set ({size} rows)")
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
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
