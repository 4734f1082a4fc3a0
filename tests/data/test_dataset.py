import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyrl.config import DataConfig
from pyrl.data import RLHFDataset, StatefulSampler, toy_task_files
from pyrl.data.preprocess import convert


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def test_toy_task_is_deterministic_with_disjoint_splits(tmp_path):
    train, val = toy_task_files(cache_dir=str(tmp_path / "a"))
    again, _ = toy_task_files(cache_dir=str(tmp_path / "b"))
    rows, val_rows = pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist()
    assert rows == pq.read_table(again).to_pylist()
    assert len(rows) + len(val_rows) == 10_000
    questions = {r["extra_info"]["question"] for r in rows}
    assert not questions & {r["extra_info"]["question"] for r in val_rows}
    a, b = rows[0]["extra_info"]["question"][:-1].split("+")
    assert rows[0]["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_dataset_batches_left_padded_prompts(tokenizer):
    train, _ = toy_task_files()
    ds = RLHFDataset(train, tokenizer, DataConfig(max_prompt_length=32))
    batch = ds.batch([0, 5], tokenizer.pad_token_id)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    assert ids.shape == (2, 32) and mask[:, -1].all() and not mask[:, 0].any()
    text = tokenizer.decode(ids[0][mask[0].bool()])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert batch.non_tensor_batch["index"].tolist() == [0, 5]
    assert batch.non_tensor_batch["data_source"][0] == "pyrl/toy_addition"


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes_and_overlong_filter(tokenizer, tmp_path, mode):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "s", "prompt": [{"role": "user", "content": "0123456789" * 3}]},
        {"data_source": "s", "prompt": [{"role": "user", "content": "1"}]}]), path)
    full = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=512, apply_chat_template=False)).prompt_ids[0]
    ds = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=10, truncation=mode, apply_chat_template=False))
    expected = {"left": full[-10:], "right": full[:10], "middle": full[:5] + full[-5:]}[mode]
    assert ds.prompt_ids[0] == expected
    filtered = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=10, filter_overlong_prompts=True))
    assert len(filtered) == 1 and filtered.filtered == 1


def test_sampler_resumes_with_the_same_batches():
    a = StatefulSampler(10, 3, seed=4)
    seen = [a.next_batch() for _ in range(5)]  # crosses into the second epoch
    b = StatefulSampler(10, 3, seed=4)
    [b.next_batch() for _ in range(2)]
    c = StatefulSampler(10, 3, seed=4)
    c.load_state_dict(b.state_dict())
    assert [c.next_batch() for _ in range(3)] == seen[2:]
    assert sorted(sum(seen[:3], [])) == sorted(set(sum(seen[:3], [])))  # no repeats within an epoch
    with pytest.raises(ValueError, match="train_batch_size=11 is larger than the data set"):
        StatefulSampler(10, 11)


def test_preprocess_gsm8k_to_verl_schema(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text('{"question": "2+2?", "answer": "two and two\\n#### 4"}\n{"question": "q", "answer": "#### 1,000"}\n')
    out = str(tmp_path / "train.parquet")
    assert convert("gsm8k", str(src), out) == 2
    rows = pq.read_table(out).to_pylist()
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[1]["reward_model"]["ground_truth"] == "1000"
    assert rows[0]["prompt"][0]["role"] == "user" and "####" in rows[0]["prompt"][0]["content"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"record 0 lacks \['answer'\]"):
        convert("gsm8k", str(bad), out)


@pytest.mark.parametrize("kind", ["gsm8k", "math", "countdown"])
def test_preprocessed_files_load_and_score_end_to_end(kind, tokenizer, tmp_path):
    """A hub-shaped file -> preprocess -> RLHFDataset batch -> default_compute_score on the batch's own
    data_source and ground truth: a right answer scores 1, a wrong one does not."""
    import json

    from pyrl.rewards import default_compute_score

    record, right, wrong = {
        "gsm8k": ({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
                  "3 plus 4 is 7\n#### 7", "#### 8"),
        "math": ({"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "It is $\\boxed{\\frac{3}{4}}$."},
                 "so we get \\boxed{\\dfrac34}", "\\boxed{0.75}"),  # verl's Hendrycks rules: no decimal = fraction
        "countdown": ({"target": 24, "nums": [2, 3, 4]}, "<think>6 times 4</think><answer>2 * 3 * 4</answer>",
                      "<answer>2 + 3 + 4</answer>"),
    }[kind]
    src = tmp_path / f"{kind}.jsonl"
    src.write_text(json.dumps(record) + "\n")
    out = str(tmp_path / f"{kind}.parquet")
    assert convert(kind, str(src), out, split="test") == 1
    data = RLHFDataset(out, tokenizer, DataConfig(max_prompt_length=4096)).batch([0], tokenizer.pad_token_id)
    source, truth = data.non_tensor_batch["data_source"][0], data.non_tensor_batch["reward_model"][0]["ground_truth"]
    assert data.non_tensor_batch["extra_info"][0]["split"] == "test"
    assert default_compute_score(source, right, truth) == 1.0
    assert default_compute_score(source, wrong, truth) < 1.0
