"""trainer.logger backends: console, jsonl, wandb (offline), tensorboard; each read back."""

import glob
import json
import math
import struct
import time

import pytest

from pyrl.trainer.tracking import Tracking, truncate_metrics

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
    with pytest.raises(ValueError, match=r"trainer.logger: unknown \['mlflow'\]"):
        Tracking(["console", "mlflow"], str(tmp_path), "p", "e", {}, total_steps=1)


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    tracker = Tracking(["jsonl"], str(tmp_path), "p", "e", {}, total_steps=3)
    log_steps(tracker)
    tracker.close()
    truncate_metrics(str(tmp_path), 2)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
