"""Make tests/verl_corpus/corpus.json: verl's example scripts that launch its PPO trainer, as Hydra override lists,
each with what verl 0.9.1 composes from it. Run once, where verl's repository and verl 0.9.1 are at hand:

    python tests/verl_corpus/make_corpus.py VERL_GIT_DIR VERL_091_PACKAGE_DIR

VERL_GIT_DIR: a git directory of github.com/volcengine/verl (its HEAD's examples/ and the one-step-off trainer's
shell/ scripts are read; the commit is recorded).
VERL_091_PACKAGE_DIR: the directory holding the `verl` package of the 0.9.1 release (its trainer/config is composed;
verl itself is not imported).

Each script runs under bash in an empty directory, with `python`, `python3`, `ray`, `torchrun` and the usual tools
that probe hardware replaced by stubs: a launch of verl.trainer.main_ppo (or the one-step-off trainer) records its
argv, so the overrides are the script's own after its variables expand, with paths and hardware counts replaced
(model and data paths by placeholders; GPUs per node and nodes kept as written). Nothing else the script does runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_verl_defaults import flat  # noqa: E402 - verl's resolved configs flattened as the defaults test does

ENTRIES = {"verl.trainer.main_ppo": "main_ppo", "recipe.one_step_off_policy.main_ppo": "one_step_off",
           "verl.experimental.one_step_off_policy.main_ppo": "one_step_off"}
# stand-ins for what a script reads from the machine or the network
STUB = r"""#!/bin/bash
# records a launch of verl's PPO trainer; anything else does nothing
for a in "$@"; do
  case "$a" in *main_ppo*) printf '%s\0' "$(basename "$0")" "$@" >> "$CORPUS_RECORD"; \
    printf '\n\0' >> "$CORPUS_RECORD";;
  esac
done
exit 0
"""
STUBS = ("python", "python3", "ray", "torchrun", "nvidia-smi", "npu-smi", "huggingface-cli", "hf", "modelscope",
         "pip", "pip3", "wget", "curl", "git", "hdfs", "sleep", "wandb", "conda", "srun", "sbatch", "scontrol",
         "mpirun", "module", "docker", "hostname", "ip", "ifconfig", "nproc")


def record_launches(script: str, examples_root: str) -> list[list[str]]:
    """The argv of each trainer launch the script makes (bash with stubs, 20 s at most)."""
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = os.path.join(tmp, "bin")
        os.makedirs(bin_dir)
        for name in STUBS:
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(STUB)
            os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
        record = os.path.join(tmp, "record")
        open(record, "w").close()
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": tmp, "CORPUS_RECORD": record, "SLURM_JOB_NUM_NODES": "1",
               "SLURM_NNODES": "1"}
        work = os.path.join(tmp, "work")
        os.makedirs(work)
        # a missing file or variable (an NPU toolkit's env script, $HDFS_ROOT) must not end the script early
        text = re.sub(r"^(\s*set\s+-.*)$", r"\1; set +eu", open(script, errors="replace").read(), flags=re.M)
        copy = os.path.join(tmp, "script.sh")
        with open(copy, "w") as f:
            f.write(text)
        subprocess.run(["bash", copy], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=20)
        # the script's own directory, where `$(pwd)` put it: paths under it relative to the checkout's root
        raw = open(record).read().replace(work + "/", "").replace(work, ".").split("\0")
    launches, current = [], []
    for item in raw:
        if item == "\n":
            if current:
                launches.append(current)
            current = []
        elif item:
            current.append(item)
    return launches


PATH_KEYS = re.compile(r"(^|\.)(path|tokenizer_path|train_files|val_files|default_local_dir|default_hdfs_dir|"
                       r"ref_model_path|external_lib|tool_config_path|interaction_config_path|"
                       r"agent_loop_config_path|model_path|rollout_data_dir|validation_data_dir)$")


def overrides_of(argv: list[str]) -> dict | None:
    """{entry, config_name, config_path, overrides} of one launch's argv, or None when it does not launch a trainer
    this corpus covers."""
    try:
        i = argv.index("-m")
    except ValueError:
        return None
    entry = ENTRIES.get(argv[i + 1])
    if entry is None:
        return None
    config_name = config_path = None
    overrides = []
    args = argv[i + 2:]
    j = 0
    while j < len(args):
        arg = args[j]
        for flag in ("--config-name", "--config-path", "-cn", "-cp"):
            if arg == flag:
                value, j = args[j + 1], j + 1
                break
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
                break
        else:
            flag = None
        if flag in ("--config-name", "-cn"):
            config_name = value.removesuffix(".yaml")
        elif flag in ("--config-path", "-cp"):
            config_path = value
        elif "=" in arg or arg.startswith("~"):
            overrides.append(placeholder(arg))
        j += 1
    return {"entry": entry, "config_name": config_name, "config_path": config_path, "overrides": overrides}


def placeholder(arg: str) -> str:
    """Model and data paths -> fixed placeholders (what verl and pyrl compose does not depend on them)."""
    key, sep, value = arg.partition("=")
    if sep and PATH_KEYS.search(key.lstrip("+~")) and value not in ("", "null", "None"):
        if value.startswith("["):
            return f"{key}=[data/a.parquet,data/b.parquet]"
        return f"{key}=path/to/{key.lstrip('+~').rsplit('.', 1)[-1]}"
    return arg


def override_value(value) -> str:
    """A YAML value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[\w./-]+", text) and text not in ("null", "true", "false"):
        return text
    # Hydra's quoted string: a quote is escaped, and so are the backslashes just before a quote or the end
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def config_file_overrides(examples_root: str, item: dict) -> tuple[str, list[str]] | None:
    """An example's own config file (--config-path under examples/): (the verl config it builds on, its values as
    `++key=value` overrides, which compose to the same values on top of that config); None for verl's own."""
    import yaml

    path = item["config_path"]
    if not path or not path.startswith("examples/"):
        return None
    with open(os.path.join(examples_root, path, item["config_name"] + ".yaml")) as f:
        tree = yaml.safe_load(f)
    bases = [d for d in tree.pop("defaults", []) if isinstance(d, str) and d != "_self_"]
    tree.pop("hydra", None)
    return bases[0], [f"++{key}={override_value(value)}" for key, value in flat(tree).items()]


# where verl keeps the scripts: examples/, and the one-step-off trainer's own shell/ directory
SCRIPT_DIRS = ("examples", "verl/experimental/one_step_off_policy/shell")


def scripts(examples: str) -> list[str]:
    found = []
    for root, _, files in os.walk(examples):
        for name in files:
            if name.endswith(".sh"):
                path = os.path.join(root, name)
                text = open(path, errors="replace").read()
                if any(entry in text for entry in ENTRIES) or "main_ppo" in text:
                    found.append(path)
    return sorted(found)


def verl_composes(package_dir: str, examples_root: str, item: dict) -> dict:
    """verl 0.9.1's resolved config for one launch, flattened to dotted keys; or {"error": ...} when Hydra refuses
    the command line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    config_dir = os.path.join(package_dir, "verl", "trainer", "config")
    name = item["config_name"] or {"main_ppo": "ppo_trainer", "one_step_off": "one_step_off_ppo_trainer"}[item["entry"]]
    overrides = list(item["overrides"])
    own_dir = not (item["config_path"] or "").startswith("examples/")  # --config-path=config: the entry's own
    if item["entry"] == "one_step_off" and own_dir:  # the one-step-off entry's config dir, on top of verl's
        overrides.append(f"hydra.searchpath=[file://{config_dir}]")
        config_dir = os.path.join(package_dir, "verl", "experimental", "one_step_off_policy", "config")
    if item["config_path"] and item["config_path"].startswith("examples/"):
        # an example's own config (examples/*/config): it names verl's config dir in its searchpath
        overrides.append(f"hydra.searchpath=[file://{config_dir}]")
        config_dir = os.path.join(examples_root, item["config_path"])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
            cfg = compose(config_name=name, overrides=overrides)
            resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # noqa: BLE001 - the record says what verl's composition said
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return {"values": flat(resolved)}


def main(git_dir: str, package_dir: str) -> None:
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(f"git --git-dir {shlex.quote(git_dir)} archive HEAD {' '.join(SCRIPT_DIRS)} | tar -x -C {tmp}",
                       shell=True, check=True)
        defaults = verl_composes(package_dir, tmp, {"entry": "main_ppo", "config_name": None, "config_path": None,
                                                    "overrides": []})
        entries = []
        for script in [s for d in SCRIPT_DIRS for s in scripts(os.path.join(tmp, d))]:
            name = os.path.relpath(script, tmp)
            launches = [o for o in map(overrides_of, record_launches(script, tmp)) if o]
            for n, item in enumerate(launches):
                composed = verl_composes(package_dir, tmp, item)
                values = composed.get("values")
                entry = {"script": name + (f"#{n + 1}" if len(launches) > 1 else ""), **item}
                own = config_file_overrides(tmp, item)
                if own:  # kept as overrides, checked here to compose to the file's values in verl
                    base, config_overrides = own
                    entry.update(config_file=item["config_name"], config_name=base, config_path=None,
                                 config_overrides=config_overrides)
                    again = verl_composes(package_dir, tmp, {"entry": item["entry"], "config_name": base,
                                                             "config_path": None,
                                                             "overrides": config_overrides + item["overrides"]})
                    assert again == composed, f"{name}: its config file as overrides composes differently"
                if values is None:
                    entry["verl_error"] = composed["error"]
                elif entry["config_name"] in (None, "ppo_trainer", "one_step_off_ppo_trainer"):
                    # what the launch names or changes (the defaults themselves are tests/verl091_defaults.json)
                    named = {o.split("=", 1)[0].lstrip("+~") for o in entry.get("config_overrides", []) +
                             entry["overrides"]}
                    entry["verl_values"] = {k: v for k, v in values.items()
                                            if k in named or defaults["values"].get(k, "<absent>") != v}
                else:  # verl's Megatron config: pyrl refuses it by name, so its values are not compared
                    entry["verl_composes"] = True
                entries.append(entry)
            if not launches:
                print(f"{name}: no trainer launch recorded", file=sys.stderr)
    out = {"source": f"github.com/volcengine/verl at {commit}, " + ", ".join(f"{d}/**/*.sh" for d in SCRIPT_DIRS),
           "composed_with": "verl 0.9.1's verl/trainer/config (Hydra compose, resolved)", "scripts": entries}
    keys = set()  # every leaf of verl 0.9.1's generated configs: the keys a verl command line may name
    for name in ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml"):
        import yaml

        with open(os.path.join(package_dir, "verl", "trainer", "config", name)) as f:
            keys.update(flat(yaml.safe_load(f)))
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "verl091_keys.json"), "w") as f:
        json.dump(sorted(keys), f, indent=0)
        f.write("\n")
    path = os.path.join(here, "corpus.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{path}: {len(entries)} launches")


if __name__ == "__main__":
    main(*sys.argv[1:3])
