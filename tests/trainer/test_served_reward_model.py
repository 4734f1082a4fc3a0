"""A reward model served as verl 0.9.1 serves it (reward.reward_model.rollout.name set; pyrl.workers.reward_server),
end to end in real runs: a generative judge asked by the user's reward function (the prompts it saw, its answers
against transformers' own greedy generation, the scores in the batch and the GRPO advantages made from them), and a
classifier in a pool of its own whose score is the reward (verl's compute_score_disrm, checked exactly on hand-built
rows against transformers' classifier)."""

import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from trainer.trainer_helpers import SMALL, compose
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import pyrl.ppo
from pyrl.config import RewardModelRolloutConfig, RewardModelSwitchConfig
from pyrl.models import tiny_model_path
from pyrl.models.tiny import tiny_classifier_path
from pyrl.protocol import DataProto
from pyrl.trainer.run_plan import resolve_run_plan
from pyrl.workers.reward_server import RewardModelServer, ServedRewardModel

# the user's side of verl's generative-reward-model contract: the prompt and the parsing of the judge's answer are
# theirs (here combined with the task's rule score); the function gets the router's address and the reward model's
# tokenizer. It logs what it sent and got.
JUDGE = """import json, urllib.request
from pyrl.rewards import default_compute_score
def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                  reward_model_tokenizer=None, log_path=None):
    prompt = 'Judge the answer to ' + extra_info['question'] + ' ' + solution_str
    body = {'model': None, 'prompt': prompt, 'max_tokens': 6, 'temperature': 0}
    request = urllib.request.Request('http://' + reward_router_address + '/v1/completions',
                                     data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=120) as answer:
        text = json.loads(answer.read())['choices'][0]['text']
    judged = (sum(reward_model_tokenizer(text, add_special_tokens=False)['input_ids']) % 7) / 6
    score = judged + default_compute_score(data_source, solution_str, ground_truth)  # a hybrid: judge + rule
    with open(log_path, 'a') as log:
        log.write(json.dumps({'solution': solution_str, 'prompt': prompt, 'judge': text, 'score': score}) + '\\n')
    return score
"""

SERVED = ["reward.reward_model.enable=true", "reward.reward_model.rollout.tensor_model_parallel_size=1",
          "reward.reward_model.rollout.name=hf", "reward.reward_model.rollout.dtype=float32",
          "reward.reward_model.rollout.prompt_length=96", "reward.reward_model.rollout.response_length=8"]


def run(tmp_path, name, *overrides):
    config = compose(*SMALL, "trainer.total_training_steps=1", "actor_rollout_ref.rollout.name=hf",
                     f"trainer.rollout_data_dir={tmp_path / name / 'rollouts'}",
                     f"trainer.default_local_dir={tmp_path / name}", *SERVED, *overrides)
    pyrl.ppo.run_ppo(config)
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][-1]
    dump = [json.loads(line) for line in (tmp_path / name / "rollouts" / "1.jsonl").read_text().splitlines()]
    return metrics, dump


def grpo_advantages(dump) -> list[float]:
    """GRPO's outcome advantage per sample, independently: (score - group mean) / (group's unbiased std + 1e-6)."""
    groups = defaultdict(list)
    for row in dump:
        groups[row["uid"]].append(row["score"])
    out = []
    for row in dump:
        scores = torch.tensor(groups[row["uid"]], dtype=torch.float64)
        std = scores.std() if len(scores) > 1 else torch.tensor(1.0, dtype=torch.float64)
        out.append(float((row["score"] - scores.mean()) / (std + 1e-6)))
    return out


def test_a_generative_judge_scores_through_the_users_function(tmp_path, ray_session):
    (tmp_path / "judge.py").write_text(JUDGE)
    log = tmp_path / "judge.jsonl"
    metrics, dump = run(tmp_path, "judge", "reward.reward_model.model_path=pyrl:tiny",
                        f"reward.custom_reward_function.path={tmp_path / 'judge.py'}",
                        f"+reward.custom_reward_function.reward_kwargs.log_path={log}", "reward.num_workers=2",
                        "reward.timeout_s=120")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == len(dump) == 32 and metrics["reward_model/requests"] == 32
    assert metrics["reward_model/latency_s/max"] >= metrics["reward_model/latency_s/mean"] > 0
    # the judge's answers are the reward model's own greedy continuations of the prompts it was sent (completions:
    # the untrained model's chat answers hardly depend on the question)
    path = tiny_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    for call in calls[:8]:
        ids = tokenizer(call["prompt"])["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        assert call["judge"] == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert metrics["reward_model/completion_tokens"] <= 32 * 6
    # the function's score is the batch's: each response scored as its call said, GRPO's advantages made from them
    by_solution = {call["solution"]: call["score"] for call in calls}
    assert all(math.isclose(row["score"], by_solution[row["output"]], abs_tol=1e-6) for row in dump)
    assert len({row["score"] for row in dump}) > 1, "every response scored alike: nothing to check advantages on"
    advantages = grpo_advantages(dump)
    assert metrics["critic/advantages/max"] == pytest.approx(max(advantages), abs=1e-4)
    assert metrics["critic/advantages/min"] == pytest.approx(min(advantages), abs=1e-4)
    assert metrics["critic/score/mean"] == pytest.approx(np.mean([row["score"] for row in dump]), abs=1e-6)


def test_a_tensor_parallel_classifier_colocated_on_two_ranks_is_the_reward(tmp_path, ray_session):
    """verl's default tensor_model_parallel_size=2, colocated: the trainer's two ranks make one replica, the first
    serving with vLLM's workers on both ranks' devices."""
    pytest.importorskip("vllm")
    overrides = ["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.rollout.name=vllm",
                 "reward.reward_model.rollout.tensor_model_parallel_size=2", "trainer.n_cpu_workers_per_node=2"]
    plan = resolve_run_plan(compose(*SMALL, *SERVED, *overrides))
    assert plan.reward_model_pool is None
    server = next(g for g in plan.groups if "reward_model" in g.roles)
    assert (server.pool, server.distributed) == ("trainer", True)  # the leader learns its group's devices
    metrics, dump = run(tmp_path, "classifier", *overrides)
    # 32 rows in /classify requests of CLASSIFY_ROWS_PER_REQUEST, each classified in one engine call
    assert metrics["reward_model/requests"] == 2 and metrics["reward_model/completion_tokens"] == 0
    scores = [row["score"] for row in dump]
    assert len(set(scores)) > 1 and metrics["critic/score/mean"] == pytest.approx(np.mean(scores), abs=1e-6)


FAILING = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n" \
          "    raise ConnectionError('the judge is down')\n"


def test_a_reward_function_failing_on_every_sample_stops_the_run(tmp_path, ray_session):
    """verl fails the step when its reward model cannot be reached; pyrl too when every sample's call failed (one
    failing sample scores 0 and is counted, as without a reward model)."""
    (tmp_path / "down.py").write_text(FAILING)
    with pytest.raises(RuntimeError, match="failed on all 32 samples with a served reward model"):
        run(tmp_path, "down", "reward.reward_model.model_path=pyrl:tiny",
            f"reward.custom_reward_function.path={tmp_path / 'down.py'}", "reward.num_workers=1")


class LocalGroup:
    """One standalone server answering as a WorkerGroup of one (its methods return a list per rank)."""

    def __init__(self, server):
        self.server = server

    def __getattr__(self, method):
        return lambda *args: [getattr(self.server, method)(*args)]


def test_the_classifier_score_is_verls_disrm_score_on_each_row():
    """compute_rm_score against transformers' classifier on verl 0.9.1's rendering (_preprocess_reward_inputs): the
    prompt's messages plus the response decoded with its special tokens, the EOS text removed, as an assistant turn in
    the reward model's chat template; the score on the last response token, an empty response scoring nothing."""
    path = tiny_classifier_path()
    section = RewardModelSwitchConfig(enable=True, model_path=path, rollout=RewardModelRolloutConfig(
        name="hf", tensor_model_parallel_size=1, dtype="float32"))
    server = RewardModelServer(section)
    server.init_model()
    server.wake_up()  # asleep until a reward step, as verl's
    config = compose(*SMALL, *SERVED, f"reward.reward_model.model_path={path}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    served = ServedRewardModel(LocalGroup(server), config, tokenizer)
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    words = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("12", "<answer>7</answer>", "x y")]
    responses = [words[0] + [tokenizer.eos_token_id], words[1] + [special[0]] + words[2], [], words[2] + [special[1]]]
    width, prompt_width = max(map(len, responses)), 3
    rows = len(responses)
    batch = {"prompts": torch.full((rows, prompt_width), tokenizer.pad_token_id),
             "responses": torch.full((rows, width), tokenizer.pad_token_id),
             "attention_mask": torch.zeros(rows, prompt_width + width, dtype=torch.long),
             "response_mask": torch.zeros(rows, width, dtype=torch.long)}
    batch["attention_mask"][:, :prompt_width] = 1
    for i, response in enumerate(responses):
        batch["responses"][i, :len(response)] = torch.tensor(response, dtype=torch.long)
        batch["attention_mask"][i, prompt_width:prompt_width + len(response)] = 1
        batch["response_mask"][i, :len(response)] = 1
    messages = [[{"role": "user", "content": f"question {i}"}] for i in range(rows)]
    data = DataProto.from_dict(batch, non_tensors={"raw_prompt": np.array(messages + [None], dtype=object)[:-1]})
    scores = served.compute_rm_score(data).batch["rm_scores"]
    rm_tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    expected = torch.zeros(rows, width)
    for i, response in enumerate(responses):
        if not response:
            continue
        text = tokenizer.decode(response).replace(tokenizer.eos_token, "")
        rendered = rm_tokenizer.apply_chat_template([*messages[i], {"role": "assistant", "content": text}],
                                                    tokenize=False)
        with torch.no_grad():
            logit = model(**rm_tokenizer(rendered, return_tensors="pt")).logits[0, -1]
        expected[i, len(response) - 1] = logit
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert (scores[2] == 0).all()
    served.close()


@pytest.mark.parametrize("overrides, message", [
    (["reward.reward_model.model_path=pyrl:tiny"], "generative model .* reward.custom_reward_function"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward_model.micro_batch_size_per_gpu=2"],
     "reward_model.micro_batch_size_per_gpu=2 is read by pyrl's FSDP scorer only"),

    (["reward.reward_model.model_path=pyrl:tiny-classifier",
      "reward.reward_model.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size=2 .*name=hf runs a "
                                                                   "replica on one device"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.rollout.name=vllm",
      "reward.reward_model.rollout.tensor_model_parallel_size=2", "reward.reward_model.enable_resource_pool=true",
      "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=3"],
     "tensor_model_parallel_size=2 does not divide reward.reward_model.n_gpus_per_node=3"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.rollout.name=vllm",
      "reward.reward_model.rollout.tensor_model_parallel_size=2"],
     "tensor_model_parallel_size=2 does not divide the trainer's 1 processes per node"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.rollout.name=vllm",
      "reward.reward_model.rollout.tensor_model_parallel_size=4", "trainer.n_cpu_workers_per_node=4"],
     "tensor_model_parallel_size=4 does not divide reward.reward_model.model_path's 2 attention heads"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.enable_resource_pool=true"],
     "nnodes=0 x n_gpus_per_node=8"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "+reward.reward_model.rollout.engine_kwargs.vllm.x=1"],
     "engine_kwargs.vllm is set, but .*name=hf"),
    (["reward.reward_model.model_path=pyrl:tiny-classifier", "reward.reward_model.rollout.quantization=fp8"],
     "quantization='fp8' is not supported"),
])
def test_served_settings_pyrl_cannot_honour_stop_the_run_at_start(overrides, message):
    config = compose(*SMALL, *SERVED, *overrides)
    with pytest.raises(ValueError, match=message):
        pyrl.ppo.run_ppo(config)


@pytest.mark.parametrize("override, message", [
    ("reward.reward_model.rollout.gpu_memory_utilization=0.9", "gpu_memory_utilization=0.9 is read by a served"),
    ("reward.reward_model.enable_resource_pool=true", "enable_resource_pool=True is read by a served"),
])
def test_a_served_models_keys_stop_a_run_of_pyrls_fsdp_scorer(override, message):
    config = compose(*SMALL, "reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny", override)
    with pytest.raises(ValueError, match=message):
        pyrl.ppo.run_ppo(config)


def test_verls_legacy_reward_model_spellings_move_to_reward_reward_model():
    config = compose(*SMALL, "reward_model.enable=true", "reward_model.model.path=pyrl:tiny-classifier",
                     "reward_model.enable_resource_pool=true", "reward_model.nnodes=1",
                     "reward_model.n_gpus_per_node=2",
                     "reward_model.rollout.name=hf", "reward_model.rollout.tensor_model_parallel_size=1")
    pyrl.ppo.resolve_defaults(config)
    section = config.reward.reward_model
    assert (section.enable, section.enable_resource_pool, section.nnodes, section.n_gpus_per_node) == (True, True, 1, 2)
    assert (section.rollout.name, section.rollout.tensor_model_parallel_size) == ("hf", 1)
