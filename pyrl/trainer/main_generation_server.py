"""python -m pyrl.trainer.main_generation_server [key=value ...]: verl 0.9.1's batch generation with the module name
changed. It reads the PPO trainer's config, as verl's does: the prompts of data.train_files (data.prompt_key: chat
messages), actor_rollout_ref.rollout.n samples of each with the rollout's sampling (temperature, top_p, top_k,
response_length; temperature 0 needs n = 1), written to data.output_path (verl: `+data.output_path=...`) as the
input's rows, every column kept, plus `responses`: a list of n strings per row. data.train_max_samples keeps that
many rows, chosen as the PPO trainer chooses its training rows (verl 0.9.1's generation reads every row, whatever
the key says).

    python -m pyrl.trainer.main_generation_server data.train_files=pyrl:toy:test \\
        actor_rollout_ref.model.path=pyrl:tiny-toy-sft actor_rollout_ref.rollout.n=4 data.output_path=/tmp/gen.parquet

The generation runs on pyrl's rollout workers (vllm or hf, tensor-parallel groups as in training) in the
trainer's pool (trainer.nnodes x n_gpus_per_node, or n_cpu_workers_per_node CPU processes), data.gen_batch_size
(else data.train_batch_size) prompts per call, with a progress line per call. The PPO config's other sections
(training, critic, reward) are not read here, as in verl. Where verl differs, on purpose:
- the chat template is applied as the PPO trainer applies it (data.apply_chat_template_kwargs,
  model.custom_chat_template); a prompt over data.max_prompt_length follows data.truncation (error by default:
  the row is named) and is never dropped (data.filter_overlong_prompts is refused here: the output keeps every row);
- verl sends every request at once to its standalone servers and seeds each server with rollout.seed + its rank
  (results change with the replica count); pyrl seeds each call from rollout.seed and the call's index (pyrl.seeding).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import hydra
from omegaconf import DictConfig

import pyrl.ppo as ppo
from pyrl.config import PPOConfig, check_no_nan, check_supported, generation_batch_size, plus_dropped_for_known

log = logging.getLogger("pyrl")

RESPONSES = "responses"  # the output column (verl's name; main_eval's data.response_key default)


class PromptRows:
    """The rows of data.train_files in file order (data.train_max_samples of them, chosen as the PPO trainer
    chooses its training rows), each with its prompt column as `raw_prompt` chat messages: the dataset PromptBatches
    tokenizes (no reward column needed: nothing is scored here)."""

    def __init__(self, data):
        import pyarrow as pa  # lazy: pyarrow loads only when a run starts

        from pyrl.data.dataset import _read_table, sample_subset  # lazy: pyrl.data loads torch

        files, prompt_key = data.train_files, data.prompt_key

        files = [files] if isinstance(files, str) else list(files)
        tables = []
        self.places = []
        for path in map(str, files):
            table = _read_table(path)
            if prompt_key not in table.column_names:
                raise ValueError(f"data file {path!r}: missing column {prompt_key!r} (has {table.column_names}); see "
                                 f"data.prompt_key")
            tables.append(table)
            self.places += [f"data file {path!r} row {row}" for row in range(table.num_rows)]
        self.table = pa.concat_tables(tables, promote_options="default")
        if self.table.num_rows == 0:
            raise ValueError(f"data.train_files: no rows in {files}")
        chosen = sorted(sample_subset(self.table.num_rows, data.train_max_samples, data))  # in file order
        if len(chosen) < self.table.num_rows:
            self.table = self.table.take(pa.array(chosen, type=pa.int64()))
            self.places = [self.places[i] for i in chosen]
        if "agent_name" in self.table.column_names:  # the trainer runs each row's loop by this column (verl's)
            for i, name in enumerate(self.table.column("agent_name").to_pylist()):
                if name not in (None, "single_turn_agent"):
                    raise ValueError(f"{self.places[i]}: agent_name {name!r}; generation is one assistant turn per "
                                     f"sample: agent loops run in the PPO trainer's rollout only")
        if RESPONSES in self.table.column_names:  # regenerating from an earlier output: replaced, as verl does
            log.info("data.train_files: its %r column is replaced by this run's generations", RESPONSES)
        self.prompts = self.table.column(prompt_key).to_pylist()
        self.prompt_key = prompt_key

    def __len__(self) -> int:
        return len(self.prompts)

    def where(self, i: int) -> str:
        return self.places[i]

    def __getitem__(self, i: int) -> dict:
        from pyrl.data.dataset import _check_messages  # lazy: pyrl.data loads torch

        return {"raw_prompt": _check_messages(self.where(i), self.prompt_key, self.prompts[i])}


def acts_on(key: str) -> bool:
    """Whether generation acts on `key`: its data, model and rollout sections, less the rollout's tool loops
    (refused here) and weight pushes (none here). The rest is what a reused training command line brings: taken,
    and neither read nor checked, as in verl."""
    return key.startswith(("data.", "actor_rollout_ref.model.", "actor_rollout_ref.rollout.")) and not \
        key.startswith(("actor_rollout_ref.rollout.multi_turn.", "actor_rollout_ref.rollout.checkpoint_engine."))


def check_generation_config(config: PPOConfig) -> None:
    """What batch generation needs of the PPO config, before anything loads."""
    from pyrl.trainer.checks import RANGES, check_device, check_ranges  # lazy: the checks import torch

    check_no_nan(config)
    check_device(config.trainer)
    # the values pyrl does not implement (pyrl.config.LIMITS) and those out of range, where generation acts
    check_supported(config, acts_on)
    check_ranges(config, {key: limit for key, limit in RANGES.items() if acts_on(key)})
    data, rollout = config.data, config.actor_rollout_ref.rollout
    if not data.output_path:
        raise ValueError("data.output_path: where to write the generations (a parquet file path; verl's command "
                         "lines pass it as +data.output_path=...)")
    if not data.train_files:
        raise ValueError("data.train_files: the parquet file(s) of prompts to generate for (or pyrl:toy:test, a "
                         "built-in task's split)")
    if rollout.temperature == 0 and rollout.n != 1:  # verl 0.9.1 asserts the same
        raise ValueError(f"actor_rollout_ref.rollout.n={rollout.n} with temperature=0: greedy samples are all the "
                         f"same; set n=1 or a temperature above 0")
    if data.filter_overlong_prompts:
        raise ValueError("data.filter_overlong_prompts=true would drop rows from the output; generation keeps every "
                         "row it reads (data.train_max_samples' subset names them in advance): set data.truncation "
                         "(left, right, middle) or raise data.max_prompt_length instead")
    # what the PPO trainer's rollout does and generation does not (nor verl 0.9.1's, which ignores these keys):
    # refused, so that a training command line reused here does not silently generate something else
    single_turn = "generation is one assistant turn per sample, the prompt rendered as data.train_files has it"
    if rollout.multi_turn.enable:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.enable=true: {single_turn}; tool calls run in the "
                         f"PPO trainer's rollout only")
    if rollout.agent.default_agent_loop != "single_turn_agent" or rollout.agent.agent_loop_config_path:
        raise ValueError(f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop!r} / "
                         f"agent_loop_config_path={rollout.agent.agent_loop_config_path!r}: {single_turn}; agent "
                         f"loops run in the PPO trainer's rollout only")
    if data.custom_cls.path:
        raise ValueError(f"data.custom_cls.path={data.custom_cls.path!r}: generation reads the rows of "
                         f"data.train_files as they are (their data.prompt_key column), not through a dataset class")
    adapter = config.actor_rollout_ref.model.lora_adapter_path
    if adapter:
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={adapter!r}: generation loads "
                         f"actor_rollout_ref.model.path's weights only, and would answer without the adapter; name a "
                         f"model with the adapter merged in (python -m pyrl.model_merger merge writes one from a "
                         f"pyrl checkpoint)")


def run_generation(config: PPOConfig) -> str:
    """Generate for every prompt of data.train_files (data.train_max_samples of them); returns data.output_path."""
    # lazy: torch, Ray and the models load only when a run starts
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pyrl.data import PromptBatches
    from pyrl.protocol import response_lengths
    from pyrl.seeding import derive_seed
    from pyrl.trainer.checks import check_engine_kwargs, check_models
    from pyrl.trainer.run_plan import resolve_generation_plan
    from pyrl.trainer.workers import build_workers
    from pyrl.workers.models import load_tokenizer

    check_generation_config(config)
    ppo.resolve_builtin_files(config)
    ppo.resolve_rollout_engine(config)
    rollout = config.actor_rollout_ref.rollout
    check_engine_kwargs(rollout)  # the other engine's options would do nothing
    if rollout.load_format == "dummy":  # verl's default: random weights until a trainer pushes its own; none here
        log.info("actor_rollout_ref.rollout.load_format=dummy (random weights until a push): the model's own weights "
                 "load instead (auto), as nothing pushes any here")
        rollout.load_format = "auto"
    plan = resolve_generation_plan(config)
    ppo.resolve_model_paths(config, plan)
    log.info("%s", plan.describe())
    data = config.data
    tokenizer = load_tokenizer(config.actor_rollout_ref.model)
    # lengths and vocabulary against the model, before workers start: prompts of at most data.max_prompt_length
    # (data.truncation), responses of actor_rollout_ref.rollout.response_length
    check_models(config, plan, tokenizer, ("data.max_prompt_length + actor_rollout_ref.rollout.response_length",
                                           data.max_prompt_length, config.actor_rollout_ref.rollout.response_length))
    rows = PromptRows(data)
    prompts = PromptBatches(rows, tokenizer, data, config.actor_rollout_ref.model.custom_chat_template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ppo.WORKERS_STARTED = True
    with build_workers(config, plan) as workers:
        per_call, n = generation_batch_size(data), rollout.n
        texts: list[list[str]] = []
        start = time.perf_counter()
        for call, first in enumerate(range(0, len(rows), per_call)):
            batch = prompts.batch(range(first, min(first + per_call, len(rows))), pad)
            batch.meta_info.update({"n": n, "temperature": rollout.temperature,
                                     "seed": derive_seed(plan.seed, "rollout", step=call, refill=0),
                                     "apply_chat_template_kwargs": dict(data.apply_chat_template_kwargs)})
            out = workers.rollout.generate_sequences(batch)  # padded to the ranks and stripped by the dispatch
            responses, lengths = out.batch["responses"], response_lengths(out).tolist()
            # as vLLM's detokenizer writes the text verl saves: no clean-up of spaces ("from . import" stays);
            # interleaved: prompt j's samples at j*n .. j*n+n-1
            decoded = [tokenizer.decode(responses[i, :lengths[i]].tolist(), skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False) for i in range(len(out))]
            texts += [decoded[j * n:(j + 1) * n] for j in range(len(batch))]
            log.info("generated for %d / %d prompts (%d samples each), %.1f s", len(texts), len(rows), n,
                     time.perf_counter() - start)
    table = rows.table.drop_columns([name for name in (RESPONSES,) if name in rows.table.column_names])
    table = table.append_column(RESPONSES, pa.array(texts, type=pa.list_(pa.string())))
    directory = os.path.dirname(os.path.abspath(data.output_path))
    os.makedirs(directory, exist_ok=True)
    partial = f"{data.output_path}.partial"
    pq.write_table(table, partial)
    os.replace(partial, data.output_path)  # whole or absent
    log.info("saved %d rows x %d responses to %s", len(texts), n, data.output_path)
    return data.output_path


@hydra.main(config_path="pkg://pyrl.configs", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    ppo.run_from_hydra(cfg, run_generation)


def cli() -> int | None:
    sys.argv = plus_dropped_for_known(sys.argv)  # verl's command lines add the output: +data.output_path=...
    return ppo.cli(main, toy_preset=False)


if __name__ == "__main__":
    sys.exit(cli())
