import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pyrl.config import DataConfig
from pyrl.data import PromptBatches, RLHFDataset, StatefulSampler, toy_task_files
from pyrl.data.preprocess import convert


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def test_toy_task_is_deterministic_with_disjoint_splits(tmp_path):
    files = toy_task_files(cache_dir=str(tmp_path / "a"))
    again = toy_task_files(cache_dir=str(tmp_path / "b"))
    rows, val_rows, test_rows = (pq.read_table(f).to_pylist() for f in files)
    assert rows == pq.read_table(again.train).to_pylist() and test_rows == pq.read_table(again.test).to_pylist()
    assert (len(val_rows), len(test_rows), len(rows) + len(val_rows) + len(test_rows)) == (256, 256, 10_000)
    splits = [{r["extra_info"]["question"] for r in split} for split in (rows, val_rows, test_rows)]
    assert sum(map(len, splits)) == len(set().union(*splits)) == 10_000  # disjoint, every pair once
    assert [split[0]["extra_info"]["split"] for split in (rows, val_rows, test_rows)] == ["train", "test", "heldout"]
    assert toy_task_files(seed=1, cache_dir=str(tmp_path / "a")).test != files.test
    a, b = rows[0]["extra_info"]["question"][:-1].split("+")
    assert rows[0]["reward_model"]["ground_truth"] == str(int(a) + int(b))


def prompts(path, tokenizer, config, **kwargs):
    return PromptBatches(RLHFDataset(path, tokenizer, config, **kwargs), tokenizer, config)


def test_dataset_batches_left_padded_prompts(tokenizer):
    train = toy_task_files().train
    ds = prompts(train, tokenizer, DataConfig(max_prompt_length=32))
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
    full = prompts(path, tokenizer, DataConfig(max_prompt_length=512, apply_chat_template=False)).prompt_ids[0]
    ds = prompts(path, tokenizer, DataConfig(max_prompt_length=10, truncation=mode, apply_chat_template=False))
    expected = {"left": full[-10:], "right": full[:10], "middle": full[:5] + full[-5:]}[mode]
    assert ds.prompt_ids[0] == expected
    filtered = prompts(path, tokenizer, DataConfig(max_prompt_length=10, filter_overlong_prompts=True))
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
    src.write_text('{"question": "2+2?", "answer": "two and two\\n#### 4"}\n'
                   '{"question": "q", "answer": "#### 1,000"}\n')
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
    data = prompts(out, tokenizer, DataConfig(max_prompt_length=4096)).batch([0], tokenizer.pad_token_id)
    source, truth = data.non_tensor_batch["data_source"][0], data.non_tensor_batch["reward_model"][0]["ground_truth"]
    assert data.non_tensor_batch["extra_info"][0]["split"] == "test"
    assert default_compute_score(source, right, truth) == 1.0
    assert default_compute_score(source, wrong, truth) < 1.0


def test_messages_keep_their_fields_as_verl_hands_them_to_the_template(tokenizer, tmp_path):
    """A prompt's messages keep every field they have (a few-shot tool call, its tool answer, a speaker's name), as
    verl 0.9.1's dataset hands them to the chat template; the fields parquet's struct column fills with None where
    a message lacks them are left out, and an assistant message calling tools may have no content."""
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}
    prompt = [{"role": "system", "content": "be brief", "name": "rules"},
              {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "content": "1", "tool_call_id": "c1"},
              {"role": "user", "content": "1+1="}]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "pyrl/toy_addition", "prompt": prompt,
                                          "reward_model": {"ground_truth": "2"}}]), path)
    raw = prompts(path, tokenizer, DataConfig(max_prompt_length=512)).batch([0], 0).non_tensor_batch["raw_prompt"][0]
    assert raw == prompt


def test_every_column_reaches_the_batch_and_reward_fn_key_any_column(tokenizer, tmp_path):
    """Columns beyond verl's known ones reach non_tensor_batch under their own names; data.reward_fn_key
    names the column the reward manager reads as the data source (the dataset renames nothing)."""
    from pyrl.rewards.managers import RewardManager

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"source": "pyrl/toy_addition", "prompt": [{"role": "user", "content": "1+1="}], "difficulty": 3,
         "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 7, "tools_kwargs": {"calc": {"x": 1}}}},
        {"source": "pyrl/toy_addition", "prompt": [{"role": "user", "content": "2+2="}], "difficulty": 5,
         "reward_model": {"ground_truth": "4"}}]), path)
    config = DataConfig(max_prompt_length=64, reward_fn_key="source")
    batch = prompts(path, tokenizer, config).batch([0, 1], tokenizer.pad_token_id)
    nt = batch.non_tensor_batch
    assert nt["difficulty"].tolist() == [3, 5] and nt["index"].tolist() == [7, 0]
    assert nt["tools_kwargs"][0] == {"calc": {"x": 1}} and nt["extra_info"][1] == {}
    assert nt["raw_prompt"][1] == [{"role": "user", "content": "2+2="}] and "prompt" not in nt
    # kept whatever data.return_raw_chat says, as verl 0.9.1's dataset (its agent loops read it)
    no_chat = prompts(path, tokenizer, DataConfig(max_prompt_length=64, reward_fn_key="source", return_raw_chat=False))
    assert no_chat.batch([1], tokenizer.pad_token_id).non_tensor_batch["raw_prompt"][0] == nt["raw_prompt"][1]
    # the reward manager reads the data source from the same column
    ids = [tokenizer("<answer>2</answer>", add_special_tokens=False)["input_ids"],
           tokenizer("<answer>5</answer>", add_special_tokens=False)["input_ids"]]
    width = max(map(len, ids))
    responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    response_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    batch.batch["prompts"] = batch.batch["input_ids"]
    batch.batch["responses"], batch.batch["response_mask"] = responses, response_mask
    batch.batch["attention_mask"] = torch.cat([batch.batch["attention_mask"], response_mask], -1)
    scores, _, _ = RewardManager(tokenizer, reward_fn_key="source", strict=True)(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0]


def test_chat_template_kwargs_custom_template_max_samples_and_workers(tokenizer, tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "s", "prompt": [{"role": "user", "content": f"q{i}"}]}
                                         for i in range(200)]), path)
    base = prompts(path, tokenizer, DataConfig(max_prompt_length=64, dataloader_num_workers=0))
    pooled = prompts(path, tokenizer, DataConfig(max_prompt_length=64, dataloader_num_workers=2))
    assert pooled.prompt_ids == base.prompt_ids and len(base) == 200  # the same items, in order
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if flag %}!{% endif %}"
    custom = PromptBatches(RLHFDataset(path, tokenizer,
                                       DataConfig(max_prompt_length=64, apply_chat_template_kwargs={"flag": True})),
                           tokenizer, DataConfig(max_prompt_length=64, apply_chat_template_kwargs={"flag": True}),
                           template)
    assert tokenizer.decode(custom.prompt_ids[3]) == "<<q3>>!"
    first = prompts(path, tokenizer, DataConfig(max_prompt_length=64, shuffle=False), max_samples=5)
    assert [r["raw_prompt"][0]["content"] for r in first.rows] == [f"q{i}" for i in range(5)]
    picked = [prompts(path, tokenizer, DataConfig(max_prompt_length=64, seed=3), max_samples=5).rows for _ in range(2)]
    assert picked[0] == picked[1] and len(picked[0]) == 5


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_prompts_tokenized_in_batches_are_each_prompts_own_ids(tokenizer, tmp_path, apply_chat_template):
    """The loader tokenizes 64 texts per call; each prompt's ids are those of tokenizing it alone (odd lengths, an
    empty message, a last batch of 3)."""
    import random

    rng = random.Random(0)
    contents = ["", "1", "0123456789" * 7] + [" ".join(str(rng.randrange(10 ** rng.randrange(1, 6)))
                                                        for _ in range(rng.randrange(1, 12))) for _ in range(128)]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "s", "prompt": [{"role": "user", "content": c}]}
                                         for c in contents]), path)
    config = DataConfig(max_prompt_length=512, apply_chat_template=apply_chat_template, shuffle=False,
                        dataloader_num_workers=0)
    loaded = prompts(path, tokenizer, config)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False) if apply_chat_template else c for c in contents]
    assert loaded.prompt_ids == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert len(loaded) == 131


def test_custom_dataset_class_with_verl_constructor_and_items(tokenizer, tmp_path):
    """A plain torch Dataset written for verl 0.9.1 (its constructor, its item dicts with raw_prompt and a
    placeholder tensor) works unchanged; an item without raw_prompt is refused naming the class and item."""
    import torch.utils.data

    class VerlStyle(torch.utils.data.Dataset):
        def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
            assert config.get("prompt_key", "prompt") == "prompt"  # how verl's datasets read their options
            self.rows = [(f"{i}+{i}=", str(2 * i)) for i in range(max_samples if max_samples > 0 else 10)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            question, answer = self.rows[i]
            return {"raw_prompt": [{"role": "user", "content": question}], "data_source": "mine",
                    "reward_model": {"ground_truth": answer}, "dummy_tensor": torch.tensor([0], dtype=torch.uint8)}

    from omegaconf import OmegaConf

    config = DataConfig(max_prompt_length=64)
    view = OmegaConf.structured(config, flags={"readonly": True})  # what pyrl.ppo.prompt_batches hands the class
    batches = PromptBatches(VerlStyle(data_files="unused", tokenizer=tokenizer, config=view, max_samples=4),
                            tokenizer, config)
    batch = batches.batch([1, 3], tokenizer.pad_token_id)
    assert len(batches) == 4 and batch.non_tensor_batch["reward_model"][1] == {"ground_truth": "6"}
    assert "dummy_tensor" not in batch.non_tensor_batch
    assert tokenizer.decode(batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()]).count("1+1=") == 1

    class NoPrompt(VerlStyle):
        def __getitem__(self, i):
            return {"data_source": "mine"}

    with pytest.raises(ValueError, match="item 0 of NoPrompt must be a dict with 'raw_prompt'"):
        PromptBatches(NoPrompt("unused", tokenizer, view), tokenizer, config)
