"""verl's own example scripts as an acceptance corpus (corpus.json, made by make_corpus.py from verl's repository and
composed with verl 0.9.1). Each launch either composes in pyrl to the values verl 0.9.1 composes, for every key both
have, and passes pyrl's start-up checks that need no model or data file; or stops at start with pyrl.verl_features'
Unsupported, naming the feature (or the value) pyrl does not implement. A launch verl 0.9.1 itself refuses is refused
by pyrl too, with a start-time error, never an internal one. Every key of verl 0.9.1's generated configs that pyrl
lacks names a feature. README's corpus table is this test's count (`python tests/verl_corpus/test_verl_corpus.py`
prints it)."""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import re
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "trainer"), str(HERE.parent)]
from test_verl_defaults import DELIBERATE, flat  # noqa: E402
from trainer_helpers import compose  # noqa: E402

CORPUS = json.loads((HERE / "corpus.json").read_text())
VERL_KEYS = json.loads((HERE / "verl091_keys.json").read_text())
VERL_DEFAULTS = json.loads((HERE.parent / "verl091_defaults.json").read_text())
README = HERE.parents[1] / "README.md"
ENTRY_CONFIGS = {"main_ppo": "ppo_trainer", "one_step_off": "one_step_off_ppo_trainer"}


def start(entry: dict) -> dict:
    """What `python -m pyrl.ppo <the launch's arguments>` does before it reads a model or a data file: the command
    line's keys, composition, the typed config, every check that needs neither. Returns the composed values."""
    from omegaconf import OmegaConf

    from pyrl.ppo import resolve_settings
    from pyrl.verl_features import check_command_line, without_effect

    overrides = without_effect(entry.get("config_overrides", []) + entry["overrides"])  # as the command line does
    check_command_line(([f"--config-name={entry['config_name']}"] if entry["config_name"] else []) + overrides)
    config = compose(*overrides, config_name=ENTRY_CONFIGS[entry["entry"]])
    values = flat(OmegaConf.to_container(OmegaConf.structured(config), resolve=True))
    resolve_settings(config)
    return values


def outcome(entry: dict) -> tuple[str, str]:
    """("accepted", "") or ("refused", the feature or value named) or ("error", the unexpected exception)."""
    from hydra.errors import HydraException

    from pyrl.verl_features import NotImplementedFeature, Unsupported

    try:
        values = start(entry)
    except NotImplementedFeature as e:
        return "refused", e.feature
    except Unsupported as e:  # a LIMITS value ("key=value is not supported (why); expected ...") or a combination
        limit = re.match(r"(\S+?)=.*? is not supported \((.*)\); expected", str(e))
        return "refused", f"{limit.group(2)} ({limit.group(1)})" if limit else str(e).split(": ")[0]
    except (ValueError, HydraException) as e:
        message = " ".join(str(e).split())
        if "verl_error" not in entry:
            return "error", message
        refused = re.search(r"'([\w.]+)'", entry["verl_error"])  # the key verl 0.9.1 stopped at, where it names one
        parts = refused.group(1).split(".") if refused else []
        if parts and not any(".".join(parts[:n]) in message for n in range(len(parts), 1, -1)):
            return "error", f"verl 0.9.1 refuses {refused.group(1)}, pyrl something else: {message}"
        return "refused-too", message
    except Exception as e:  # noqa: BLE001 - an internal error is this test's finding
        return "error", f"{type(e).__name__}: {e}"
    if "verl_error" in entry:
        return "error", f"verl 0.9.1 refuses it ({entry['verl_error']}), pyrl accepts it"
    differ = {key: (values[key], verl) for key, verl in entry.get("verl_values", {}).items()
              if key in values and values[key] != verl}
    differ.update({key: (values[key], verl) for key, verl in VERL_DEFAULTS.items()
                   if key not in entry.get("verl_values", {}) and key in values and values[key] != verl
                   and key not in DELIBERATE})  # pyrl's deliberate defaults: README
    return ("accepted", "") if not differ else ("error", f"composes differently from verl 0.9.1: {differ}")


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    """verl's scripts log to wandb; without credentials pyrl would (rightly) stop at the logger check. pyrl's
    warnings are quiet for these tests only (a level left set would hide them from later tests' caplog)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = logging.getLogger("pyrl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_the_corpus_is_verl_s_example_scripts():
    scripts = CORPUS["scripts"]
    assert CORPUS["source"].startswith("github.com/volcengine/verl at ")
    assert len(scripts) >= 120 and len({s["script"] for s in scripts}) == len(scripts)
    assert sum("verl_error" not in s for s in scripts) >= 75  # the rest: keys verl 0.9.1 does not have


@pytest.mark.parametrize("entry", CORPUS["scripts"], ids=[s["script"].removeprefix("examples/") for s in
                                                          CORPUS["scripts"]])
def test_a_verl_example_composes_as_in_verl_or_is_refused_by_feature(entry):
    kind, detail = outcome(entry)
    assert kind != "error", detail


def test_every_verl_key_pyrl_lacks_names_a_feature():
    from pyrl.config import unknown_node
    from pyrl.verl_features import feature_of, no_effect

    assert len(VERL_KEYS) > 1000
    unnamed = [key for key in VERL_KEYS if unknown_node(key) and not feature_of(key) and not no_effect(key)]
    assert not unnamed, f"verl 0.9.1 keys pyrl lacks that no feature names: {unnamed}"
    assert feature_of("actor_rollout_ref.actor.bogus_key") is None  # a key verl lacks too stays unknown


@pytest.mark.parametrize("argv, message", [
    (["--config-name=ppo_megatron_trainer"], r"Megatron strategy: not implemented in pyrl \(--config-name="),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     r"Megatron strategy: not implemented in pyrl \(actor_rollout_ref\.actor\.megatron\.tensor_model_parallel_size=2 "),
    (["+actor_rollout_ref.actor.profiler.enable=True"], r"verl's profilers .*profiler\.enable=True asks for it"),
    (["++data.image_key=images"], r"multimodal \(image, video, audio\) inputs"),
    (["+actor_rollout_ref.model.target_parameters=[experts.w1]"], r"LoRA on parameters that are not linear layers"),
    (["~actor_rollout_ref.actor.entropy_checkpointing"],
     r"verl's chunked and checkpointed entropy .*\(~actor_rollout_ref\.actor\.entropy_checkpointing "),
    (["+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1"],
     r"verl's engine optimizer options .*override_optimizer_config\.optimizer_offload_fraction=1 asks for it"),
    (["critic.model.fsdp_config.param_offload=True", "critic.model.fsdp_config.optimizer_offload=True"],
     r"^unknown config key: critic\.model\.fsdp_config \(did you mean critic\.model\.override_config\?\)\. "),
])
def test_every_override_form_is_checked_before_hydra(argv, message):
    from pyrl.verl_features import check_command_line

    with pytest.raises(ValueError, match=message):
        check_command_line(["preset=toy", *argv])
    check_command_line(["preset=toy", "hydra.run.dir=.", "+actor_rollout_ref.model.override_config.a=1",
                        "++trainer.total_epochs=2", "~trainer.val_before_train"])


def test_keys_without_effect_are_dropped_saying_so(capsys):
    """verl 0.9.1 keys that change no number there either (use_torch_compile compiles verl's entropy function,
    skip_tokenizer_init is hard-coded off in its vLLM server) are taken at any value, in any override form, each
    said in one line; the same name elsewhere stays an unknown key."""
    from pyrl.verl_features import check_command_line, without_effect

    argv = ["actor_rollout_ref.actor.use_torch_compile=False", "+actor_rollout_ref.ref.fsdp_config.use_torch_compile=0",
            "~critic.fsdp.use_torch_compile", "++actor_rollout_ref.rollout.skip_tokenizer_init=true",
            "data.train_batch_size=8"]
    assert without_effect(argv) == ["data.train_batch_size=8"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 4 and all("accepted, with no effect (verl 0.9.1" in line for line in said), said
    with pytest.raises(ValueError, match=r"unknown config key: critic\.model\.use_torch_compile"):
        check_command_line(without_effect(["critic.model.use_torch_compile=false"]))


@pytest.mark.parametrize("arg", ["algorithm.use_pf_ppo=False", "+algorithm.filter_groups.max_inflight_gen_batches=1",
                                 "actor_rollout_ref.model.use_liger=false", "~critic.model.enable_activation_offload",
                                 "actor_rollout_ref.model.tiled_mlp.enabled=false", "critic.model.external_lib=null",
                                 "actor_rollout_ref.actor.entropy_checkpointing=false",
                                 "algorithm.pf_ppo.weight_pow=3", "actor_rollout_ref.ref.entropy_checkpointing=true",
                                 "actor_rollout_ref.ref.rollout_n=4", "critic.rollout_n=2",
                                 "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"])
def test_a_feature_turned_off_is_taken_without_effect(arg, capsys):
    """A verl key of a feature pyrl lacks, at the value that turns it off (verl's default), changes nothing: taken
    with one line; any other value names the feature."""
    from pyrl.verl_features import without_effect

    assert without_effect([arg, "data.train_batch_size=8"]) == ["data.train_batch_size=8"]
    assert "accepted, with no effect" in capsys.readouterr().err


@pytest.mark.parametrize("arg, feature", [("algorithm.use_pf_ppo=true", "PF-PPO"),
                                          ("algorithm.filter_groups.max_inflight_gen_batches=4", "asynchronous"),
                                          ("actor_rollout_ref.model.use_liger=True", "Liger"),
                                          ("actor_rollout_ref.actor.entropy_checkpointing=true", "chunked")])
def test_a_feature_turned_on_is_still_refused(arg, feature):
    from pyrl.verl_features import check_command_line, without_effect

    with pytest.raises(ValueError, match=feature):
        check_command_line(without_effect([arg]))


def corpus_table() -> str:
    """README's table: per outcome (accepted, or refused naming a feature or value), the launches verl 0.9.1
    composes and those it refuses itself (keys 0.9.1 does not have: the scripts were written for another verl)."""
    counts: dict = collections.defaultdict(lambda: [0, 0])
    for entry in CORPUS["scripts"]:
        kind, detail = outcome(entry)
        row = {"accepted": "composes to verl 0.9.1's values; pyrl's start-up checks pass",
               "refused-too": "refused: a key neither verl 0.9.1 nor pyrl has"}.get(kind, f"refused: {detail}")
        counts[row]["verl_error" in entry] += 1
    rows = sorted(counts.items(), key=lambda item: (not item[0].startswith("composes"), -sum(item[1]), item[0]))
    total = [sum(n[0] for _, n in rows), sum(n[1] for _, n in rows)]
    return "\n".join(["| outcome in pyrl | launches verl 0.9.1 composes | launches verl 0.9.1 refuses |",
                      "|---|---|---|", *(f"| {row} | {a} | {b} |" for row, (a, b) in rows),
                      f"| all | {total[0]} | {total[1]} |"])


def test_the_readme_table_is_the_corpus_count():
    text = README.read_text()
    found = re.search(r"<!-- corpus table: .*? -->\n(.*?)\n<!-- end corpus table -->", text, re.S)
    assert found, "README.md lacks the corpus table markers"
    assert found.group(1).strip() == corpus_table(), "README's corpus table is stale: run " \
                                                      "python tests/verl_corpus/test_verl_corpus.py"


if __name__ == "__main__":
    os.environ["WANDB_MODE"] = "offline"
    logging.disable(logging.WARNING)
    print(corpus_table())
