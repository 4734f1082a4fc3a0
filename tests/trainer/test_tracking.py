"""trainer.logger backends: console (terminal or not), jsonl, file, wandb (offline), tensorboard, mlflow (a local
file store); each read back."""

import glob
import io
import json
import math
import struct
import sys
import time

import pytest

from pyrl.trainer import tracking
from pyrl.trainer.tracking import Tracking, check_backends, truncate_metrics

STEPS = [{"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "bad": math.nan},
         {"critic/score/mean": 0.5, "actor/pg_loss": 0.125, "val-core/toy/reward/mean@1": 0.75},
         {"critic/score/mean": 1.0, "actor/pg_loss": 2.0, "label": "not a number"}]
SAMPLES = [{"input": "12+34=", "output": "<answer>46</answer>", "gts": "46", "score": 1.0},
           {"input": "1|2", "output": "x\ny", "gts": "3", "score": 0.0}]


def wandb_history(run_dir) -> dict:
    """step -> {key: value} from an offline run's transaction log (what `wandb sync` uploads): LevelDB's
    log format (32 KiB blocks of crc32 / length / type-framed chunks) of wandb Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    data, pos, block, records, pending = open(path, "rb").read(), 7, 32768, [], b""  # 7: the ':W&B' header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk the service process is still writing: read again later
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, or middle / last
        if kind in (1, 4):
            records.append(pending)
    history = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def log_steps(tracker):
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step=step)
    tracker.log_generations(SAMPLES, step=3)


def test_console_and_jsonl(tmp_path, capsys):
    tracker = Tracking(["console", "jsonl"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -0.5},  # NaN and text are left out
                    {"step": 2, "critic/score/mean": 0.5, "actor/pg_loss": 0.125, "val-core/toy/reward/mean@1": 0.75},
                    {"step": 3, "critic/score/mean": 1.0, "actor/pg_loss": 2.0}]
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["step", "score"])
    assert lines.count(header) == 1
    step2 = next(line.split() for line in lines if line.split()[:1] == ["2"])
    assert step2[1:4] == ["0.5", "0.75", "0.125"]
    assert "validation generations at step 3:" in out and "'12+34=' -> '<answer>46</answer>'  (expected 46)" in out


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(["wandb"], str(tmp_path), "proj", "exp", {"data": {"train_batch_size": 8}}, total_steps=3)
    log_steps(tracker)
    run = tracker.wandb
    assert run.offline and run.project == "proj" and run.name == "exp"
    assert run.config["data"]["train_batch_size"] == 8
    # wandb commits a step when a later one starts (the last one at finish): steps 1-2 are in the summary
    assert run.summary["critic/score/mean"] == 0.5 and run.summary["val-core/toy/reward/mean@1"] == 0.75
    assert "bad" not in run.summary.keys()
    tracker.close()
    run_dirs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    # wandb's service process writes the transaction log on its own: finish() can return before the last records
    # reach the file, so read until they are all there (or give up after 20 s and show what arrived)
    deadline = time.monotonic() + 20
    while sorted(history := wandb_history(run_dirs[0])) != [1, 2, 3] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(history) == [1, 2, 3]
    for step, metrics in enumerate(STEPS, start=1):
        expected = {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
        assert {k: v for k, v in history[step].items() if not k.startswith("val/generations")} == expected
    assert history[3]["val/generations/_type"] == "table-file"  # the table, by reference to its file
    tables = glob.glob(f"{run_dirs[0]}/files/media/table/val/generations_3_*.table.json")
    table = json.load(open(tables[0]))
    assert table["columns"] == ["step", "input", "output", "gts", "score"]
    assert table["data"] == [[3, "12+34=", "<answer>46</answer>", "46", 1.0], [3, "1|2", "x\ny", "3", 0.0]]


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking(["tensorboard"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, -0.5), (2, 0.125), (3, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("val-core/toy/reward/mean@1")] == [(2, 0.75)]
    assert "bad" not in events.Tags()["scalars"]
    text = events.Tensors("val/generations/text_summary")[0]
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 3 and "| 3 | 12+34= | <answer>46</answer> | 46 | 1.0 |" in table
    assert "| 3 | 1\\|2 | x y | 3 | 0.0 |" in table  # cells escaped so the markdown table stays a table


def test_unknown_backend_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger: unknown \['mlfow'\], expected some of \['console', 'jsonl', "
                                         r"'file', 'wandb', 'tensorboard', 'mlflow'\]"):
        Tracking(["console", "mlfow"], str(tmp_path), "p", "e", {}, total_steps=1)
    assert check_backends("file") == ["file"]


def test_missing_package_names_the_extra(monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(ImportError, match=r"trainer.logger=mlflow needs the mlflow package.*'pyrl\[tracking\]'"):
        check_backends(["console", "mlflow"])


def test_wandb_without_credentials_stops_before_the_run(tmp_path, monkeypatch):
    """verl's default logger includes wandb: with no credentials anywhere wandb looks, the start-up check stops the
    run naming the remedies; each source of credentials, or an offline mode, lets it through."""
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
                 "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no wandb credentials for api\.wandb\.ai .*WANDB_MODE=offline.*"
                                         r"trainer\.logger=\[console,jsonl\]"):
        check_backends(["console", "wandb"])
    assert check_backends(["console", "jsonl"]) == ["console", "jsonl"]  # no wandb: nothing to check
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "k" * 40)):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert check_backends(["wandb"]) == ["wandb"]
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert check_backends(["wandb"]) == ["wandb"]
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a server of one's own: its entry counts
    with pytest.raises(ValueError, match=r"no wandb credentials for wandb\.example\.com"):
        check_backends(["wandb"])
    settings = tmp_path / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert check_backends(["wandb"]) == ["wandb"]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    tracker = Tracking(["jsonl"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    truncate_metrics(str(tmp_path), 2)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_console_off_a_terminal_prints_plain_lines(tmp_path, capsys):
    """stdout to a file / CI / nohup: the table and the samples as plain lines, no progress bar redraws."""
    assert not sys.stdout.isatty()  # capsys's capture
    tracker = Tracking(["console"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err and captured.err == ""
    lines = captured.out.splitlines()
    assert lines[0].split() == ["step", "score", "val", "pg_loss", "entropy", "ppo_kl", "vf_loss", "resp_len", "gen_s",
                                "step_s"]
    assert [line.split()[:3] for line in lines[1:4]] == [["1", "0.25", "-"], ["2", "0.5", "0.75"], ["3", "1", "-"]]
    assert lines[4:] == ["validation generations at step 3:",
                         "  score 1  '12+34=' -> '<answer>46</answer>'  (expected 46)",
                         "  score 0  '1|2' -> 'x\\ny'  (expected 3)"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_console_on_a_terminal_keeps_the_bar(tmp_path, monkeypatch):
    out, err = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    tracker = Tracking(["console"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    assert "\r" in err.getvalue() and "3/3" in err.getvalue()  # the bar, redrawn on stderr
    assert [line.split()[0] for line in out.getvalue().splitlines()[:4]] == ["step", "1", "2", "3"]


def test_file_backend_writes_verls_lines_to_verls_path(tmp_path, monkeypatch):
    """verl's FileLogger: $VERL_FILE_LOGGER_ROOT (default .)/project/experiment.jsonl, or $VERL_FILE_LOGGER_PATH;
    one compact (orjson's layout) {"step": k, "data": {...}} line per step. A fresh run starts the file over (as
    verl's); a run resumed at step k keeps steps <= k and appends (nothing repeated, nothing lost)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    expected = ['{"step":1,"data":{"critic/score/mean":0.25,"actor/pg_loss":-0.5}}',
                '{"step":2,"data":{"critic/score/mean":0.5,"actor/pg_loss":0.125,"val-core/toy/reward/mean@1":0.75}}',
                '{"step":3,"data":{"critic/score/mean":1.0,"actor/pg_loss":2.0}}']
    for _ in range(2):  # the second fresh run replaces the first's lines
        tracker = Tracking(["file"], str(tmp_path / "run"), "proj", "exp", {}, total_steps=3)
        log_steps(tracker)
        tracker.close()
    path = tmp_path / "proj" / "exp.jsonl"
    assert path.read_text().splitlines() == expected
    resumed = Tracking(["file"], str(tmp_path / "run"), "proj", "exp", {}, total_steps=3, initial_step=1)
    assert path.read_text().splitlines() == expected[:1]
    resumed.log({"critic/score/mean": 0.5}, step=2)
    resumed.close()
    assert path.read_text().splitlines() == expected[:1] + ['{"step":2,"data":{"critic/score/mean":0.5}}']

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    Tracking(["file"], str(tmp_path / "run"), "proj", "exp", {}, total_steps=1).log({"x": 1}, step=1)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "logs" / "metrics.jsonl"))
    tracker = Tracking(["file"], str(tmp_path / "run"), "proj", "exp", {}, total_steps=1)
    tracker.log({"x": 2}, step=1)  # on disk before close: written through every step
    assert (tmp_path / "logs" / "metrics.jsonl").read_text() == '{"step":1,"data":{"x":2.0}}\n'
    tracker.close()
    assert (tmp_path / "root" / "proj" / "exp.jsonl").read_text() == '{"step":1,"data":{"x":1.0}}\n'


@pytest.mark.parametrize("store", ["default ./mlruns", "MLFLOW_TRACKING_URI=file://"])
def test_mlflow_local_file_store(tmp_path, monkeypatch, store):
    """mlflow-skinny offline: experiment = project, run name = experiment, the config as params, metrics under
    verl's sanitised names, the generations as verl's val_step{k}.json artifact; read back with mlflow's client."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # Tracking opts in; monkeypatch unsets it again afterwards
    uri = (tmp_path / "mlruns").as_uri()
    if store.startswith("MLFLOW_TRACKING_URI"):
        uri = (tmp_path / "elsewhere").as_uri()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {"data": {"train_batch_size": 8, "train_files": ["a.parquet", "b.parquet"]},
              "trainer": {"logger": ["mlflow"]}}
    tracker = Tracking(["mlflow"], str(tmp_path / "run"), "proj", "exp", config, total_steps=3)
    log_steps(tracker)
    tracker.close()

    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params == {"data/train_batch_size": "8", "data/train_files/list_len": "2",
                               "data/train_files/0": "a.parquet", "data/train_files/1": "b.parquet",
                               "trainer/logger/list_len": "1", "trainer/logger/0": "mlflow"}
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert history("actor/pg_loss") == [(1, -0.5), (2, 0.125), (3, 2.0)]
    assert history("val-core/toy/reward/mean_at_1") == [(2, 0.75)]  # "@" is not allowed in mlflow names
    assert set(run.data.metrics) == {"critic/score/mean", "actor/pg_loss", "val-core/toy/reward/mean_at_1"}
    path = client.download_artifacts(run.info.run_id, "val_step3.json", str(tmp_path))
    assert json.load(open(path)) == [{"input": "12+34=", "output": "<answer>46</answer>", "score": 1.0},
                                     {"input": "1|2", "output": "x\ny", "score": 0.0}]
