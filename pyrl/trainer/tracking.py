"""Where metrics go (trainer.logger): console (a compact line per step, a header every 20 steps; under a
progress bar over steps on a terminal, as plain lines otherwise), jsonl (RUN_DIR/metrics.jsonl, one object per
step with a `step` field), file (verl's FileLogger: {"step": k, "data": {...}} lines), wandb (honours
WANDB_MODE=offline), tensorboard (RUN_DIR/tensorboard) and mlflow (MLFLOW_TRACKING_URI, default ./mlruns).
Validation generations (trainer.log_val_generations) go to the console, a wandb table, tensorboard text and an
mlflow artifact."""

from __future__ import annotations

import configparser
import importlib.util
import json
import logging
import math
import netrc
import os
import re
import sys
from urllib.parse import urlparse

from tqdm import tqdm

log = logging.getLogger("pyrl")

# backend -> the module it imports (None: nothing beyond pyrl's own dependencies); all come with pyrl[tracking]
BACKENDS = {"console": None, "jsonl": None, "file": None, "wandb": "wandb", "tensorboard": "tensorboard",
            "mlflow": "mlflow"}
CONSOLE_COLUMNS = [("critic/score/mean", "score"), ("val-core/*", "val"), ("actor/pg_loss", "pg_loss"),
                   ("actor/entropy", "entropy"), ("actor/ppo_kl", "ppo_kl"), ("critic/vf_loss", "vf_loss"),
                   ("response_length/mean", "resp_len"), ("timing_s/gen", "gen_s"), ("timing_s/step", "step_s")]


def check_backends(backends) -> list[str]:
    """trainer.logger as a list, checked before anything starts: every name known, every package installed."""
    backends = [backends] if isinstance(backends, str) else list(backends)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"trainer.logger: unknown {unknown}, expected some of {list(BACKENDS)}")
    for backend in backends:
        module = BACKENDS[backend]
        if module and importlib.util.find_spec(module) is None:
            raise ImportError(f"trainer.logger={backend} needs the {module} package, which the tracking extra brings: "
                              "pip install 'pyrl[tracking]' (pip install -e '.[tracking]' in a checkout)")
    if "wandb" in backends:
        check_wandb_credentials()
    return backends


WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")  # WANDB_MODE values that need no server


def check_wandb_credentials() -> None:
    """trainer.logger includes wandb (verl's default, [console, wandb]): unless WANDB_MODE says offline, the
    credentials wandb would find (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the host's entry in .netrc, an api_key in
    wandb's settings files) must exist, or the run stops now, naming the remedies. Without this it stopped at the
    first logged step, after the workers had started, with wandb's login traceback. Stopping rather than falling
    back to offline: a run the user expects on their dashboard must not quietly log to local files instead."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES or \
            os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    for path in (os.path.join(config_dir, "settings"), os.path.join("wandb", "settings")):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_option("default", "api_key"):
            return
    raise ValueError(f"trainer.logger includes wandb (verl's default logger is [console, wandb]), but no wandb "
                     f"credentials for {host} were found (WANDB_API_KEY, `wandb login`'s .netrc entry): log in, set "
                     "WANDB_MODE=offline (sync later with `wandb sync`), or choose other loggers, e.g. "
                     "trainer.logger=[console,jsonl]")


def metrics_file(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def file_logger_path(project: str, experiment: str) -> str:
    """verl's FileLogger location: $VERL_FILE_LOGGER_PATH, else $VERL_FILE_LOGGER_ROOT (default
    .)/project/experiment.jsonl."""
    path = os.getenv("VERL_FILE_LOGGER_PATH")
    if path is None:
        path = os.path.join(os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", ".")), project, f"{experiment}.jsonl")
    return path


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Drop metrics.jsonl's entries after `last_step` (a resumed run repeats them; -1: a fresh run, all)."""
    truncate_step_lines(metrics_file(run_dir), last_step)


def truncate_step_lines(path: str, last_step: int) -> None:
    """Drop a JSON-lines log's entries whose "step" is after `last_step`, rewriting the file atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _markdown_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flat_params(value, prefix: str = "") -> dict:
    """The config as mlflow params, keys joined by "/" and a list as {list_len, 0, 1, ...}, as verl logs it."""
    if isinstance(value, (list, tuple)):
        value = {"list_len": len(value), **{str(i): v for i, v in enumerate(value)}}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat_params(item, f"{prefix}{key}/").items()}
    return {prefix[:-1]: value}


class _MlflowKeys:
    """verl's metric-name sanitising: mlflow accepts only alphanumerics, _ - . : / and spaces, and no "//"."""

    def __init__(self):
        self.cache: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        if key not in self.cache:
            clean = re.sub(r"[^/\w.\- :]", "_", re.sub(r"/+", "/", key.replace("@", "_at_")))
            if clean != key:
                log.warning("[MLflow] Metric key '%s' sanitized to '%s' due to invalid characters.", key, clean)
            self.cache[key] = clean
        return self.cache[key]


class Tracking:
    def __init__(self, backends, run_dir: str, project: str, experiment: str, config: dict, total_steps: int,
                 initial_step: int = 0, columns=None):
        """columns: the console table's (metric or prefix*, label) pairs (CONSOLE_COLUMNS: a PPO run's)."""
        backends = check_backends(backends)
        self.columns = columns or CONSOLE_COLUMNS
        self.backends, self.run_dir, self.closed = backends, run_dir, False
        os.makedirs(run_dir, exist_ok=True)
        # the bar redraws its line with \r: on a log file, CI or nohup the table goes out as plain lines instead
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step", dynamic_ncols=True,
                        disable="console" not in backends or not (sys.stdout.isatty() and sys.stderr.isatty()))
        self.lines = 0
        self.jsonl = open(metrics_file(run_dir), "a") if "jsonl" in backends else None
        self.file = self.wandb = self.tensorboard = self.mlflow = None
        if "file" in backends:
            path = file_logger_path(project, experiment)
            # as metrics.jsonl: a fresh run starts the file over, a resumed one drops the steps it will repeat
            truncate_step_lines(path, initial_step if initial_step > 0 else -1)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            # O_APPEND and one unbuffered write per step: each line lands whole, even beside other appenders
            self.file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            log.info("file logger: %s", os.path.abspath(path))
        if "wandb" in backends:
            import wandb  # lazy: wandb is optional

            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=run_dir, resume="allow")
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional

            # verl's $TENSORBOARD_DIR where set; else beside the run's other outputs (verl: tensorboard_log/P/E)
            self.tensorboard = SummaryWriter(os.environ.get("TENSORBOARD_DIR") or os.path.join(run_dir, "tensorboard"))
        if "mlflow" in backends:
            self._start_mlflow(project, experiment, config)

    def _start_mlflow(self, project: str, experiment: str, config: dict) -> None:
        """verl's MlflowLogger: experiment = project, run name = experiment, the config as params; attaches to
        $MLFLOW_RUN_ID when set. verl's default store is sqlite:////tmp/mlruns.db, which needs full mlflow's
        SQLAlchemy; pyrl's tracking extra brings mlflow-skinny, so the default is the file store ./mlruns."""
        import mlflow  # lazy: mlflow is optional

        uri = os.environ.get("MLFLOW_TRACKING_URI") or os.path.abspath("mlruns")
        if urlparse(uri).scheme in ("", "file"):  # mlflow 3 refuses its file store unless opted in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        if os.environ.get("MLFLOW_RUN_ID"):
            self.mlflow = mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
        else:
            self.mlflow = mlflow.start_run(experiment_id=mlflow.set_experiment(project).experiment_id,
                                           run_name=experiment)
        self.mlflow_key = _MlflowKeys()
        mlflow.log_params({self.mlflow_key(k): v for k, v in _flat_params(config).items()})

    def _to_mlflow(self, what: str, step: int, call) -> None:
        """A tracking server's hiccup costs that step's record, not the run (mlflow's client retries first)."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - whatever the store raises
            log.warning("mlflow: logging %s at step %d failed: %s", what, step, e)

    def log(self, metrics: dict, step: int, advance: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.file is not None:  # orjson's compact layout, as verl writes it
            line = json.dumps({"step": step, "data": clean}, separators=(",", ":"), ensure_ascii=False) + "\n"
            os.write(self.file, line.encode())
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.tensorboard is not None:
            for key, value in clean.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.mlflow is not None:
            import mlflow  # lazy: mlflow is optional

            self._to_mlflow("metrics", step, lambda: mlflow.log_metrics(
                {self.mlflow_key(k): v for k, v in clean.items()}, step=step))
        if "console" in self.backends:
            self._console(clean, step)
            if advance:
                self.bar.update()

    def log_generations(self, records: list[dict], step: int) -> None:
        """A few validation samples: input, output, score (and ground truth) as text / a table."""
        if not records:
            return
        columns = ["step", "input", "output", "gts", "score"]
        rows = [[step, r["input"], r["output"], str(r.get("gts")), r["score"]] for r in records]
        if "console" in self.backends:
            self._print(f"validation generations at step {step}:")
            for _, text_in, text_out, gts, score in rows:
                self._print(f"  score {score:.3g}  {text_in!r} -> {text_out!r}  (expected {gts})")
        if self.wandb is not None:
            import wandb  # lazy: wandb is optional

            self.wandb.log({"val/generations": wandb.Table(columns=columns, data=rows)}, step=step)
        if self.tensorboard is not None:
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rows]
            self.tensorboard.add_text("val/generations", "\n".join(table), step)
        if self.mlflow is not None:  # verl's artifact: val_step{k}.json, [{input, output, score}, ...]
            import mlflow  # lazy: mlflow is optional

            samples = [{"input": r["input"], "output": r["output"], "score": r["score"]} for r in records]
            self._to_mlflow("generations", step, lambda: mlflow.log_dict(samples, f"val_step{step}.json"))

    def _print(self, line: str) -> None:
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def _console(self, metrics: dict, step: int) -> None:
        def pick(pattern):
            if pattern.endswith("*"):
                hits = [v for k, v in metrics.items() if k.startswith(pattern[:-1])]
                return hits[0] if hits else None
            return metrics.get(pattern)

        if self.lines % 20 == 0:
            self._print(" ".join(f"{label:>9}" for label in ["step"] + [c[1] for c in self.columns]))
        cells = [f"{step:>9d}"] + [f"{'-':>9}" if (v := pick(p)) is None else f"{v:>9.4g}" for p, _ in self.columns]
        self._print(" ".join(cells))
        self.lines += 1

    def close(self) -> None:
        """Idempotent: fit closes early on Ctrl-C, so its last line comes after the bar's."""
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.file is not None:
            os.close(self.file)
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.mlflow is not None:
            import mlflow  # lazy: mlflow is optional

            mlflow.end_run()
