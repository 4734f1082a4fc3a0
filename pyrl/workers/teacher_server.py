"""On-policy distillation's teachers served from a pool of their own (verl 0.9.1: distillation.n_gpus_per_node x
nnodes devices, a vLLM server per teacher replica scoring the student's sequences with prompt_logprobs).

A TeacherServer process is one replica of one teacher (pyrl.algos.distillation.teacher_replicas lays the pool out:
the teachers in the config's order, each its replicas, a process each holding the replica's devices). It scores
whole sequences (the student's prompt and response) at temperature 1: at each response token, the teacher's top-k
tokens and their log-probs (forward_kl_topk), or the log-prob of the token the student sampled (estimator modes),
with

- vLLM (inference.name=vllm): one request per sequence with prompt_logprobs=k and one generated token, the top k by
  rank read as verl's extract_prompt_logprobs reads them; the server keys verl's teacher takes (gpu_memory_utilization,
  tensor_model_parallel_size: vLLM's own worker per device, max_num_seqs, engine_kwargs.vllm, ...);
- pyrl's hf engine (inference.name=hf): the teacher's transformers forward over micro-batches of at most
  inference.max_num_batched_tokens tokens, log-softmax in float32.

score_batch (the trainer's teacher pass) routes each row to its teacher (route_rows), spreads a teacher's rows over
its replicas by tokens, and lays the answers out as the colocated pass does (ActorRolloutRefWorker.
compute_teacher_log_probs): teacher_topk_log_probs / teacher_topk_ids [B, R, k] or teacher_log_probs [B, R], 0
after each response's end.
"""

from __future__ import annotations

import logging

import torch

from pyrl.algos import distillation as D
from pyrl.config import RolloutConfig
from pyrl.controller import Dispatch, Worker, register
from pyrl.protocol import DataProto
from pyrl.workers.distributed import worker_device

log = logging.getLogger("pyrl")


def replica_of(distillation, rank: int) -> tuple[str, object, int]:
    """(entry name, TeacherModelConfig, replica index) served by the pool's process `rank`."""
    replicas = D.teacher_replicas(distillation)
    for (name, teacher, _), ranks in zip(replicas, ranks_of(distillation)):
        if rank in ranks:
            return name, teacher, ranks.index(rank)
    raise ValueError(f"teacher server rank {rank}: the pool's {sum(r for _, _, r in replicas)} replicas are fewer "
                     f"(distillation.teacher_models' num_replicas)")


def ranks_of(distillation) -> list[list[int]]:
    """Each teacher's server ranks, in teachers_of's order."""
    out, first = [], 0
    for _, _, replicas in D.teacher_replicas(distillation):
        out.append(list(range(first, first + replicas)))
        first += replicas
    return out


def teacher_engine_config(inference, topk: int, seed: int):
    """pyrl's vLLM engine settings (pyrl.config.RolloutConfig) for a teacher replica, as verl prepares its teacher
    server: room for the student's prompt and whole response plus one token, the raw log-probs, max_logprobs >= k
    (engine_kwargs.vllm.max_logprobs, set to k where unset), and no sleep (the pool is the teacher's alone)."""
    vllm_kwargs = dict(inference.engine_kwargs.get("vllm") or {})
    if vllm_kwargs.get("max_logprobs") is None:
        vllm_kwargs["max_logprobs"] = max(topk, 1)
    return RolloutConfig(
        name="vllm", dtype=inference.dtype, gpu_memory_utilization=inference.gpu_memory_utilization,
        tensor_model_parallel_size=inference.tensor_model_parallel_size,
        max_num_batched_tokens=inference.max_num_batched_tokens, max_num_seqs=inference.max_num_seqs,
        max_model_len=inference.max_model_len, enable_chunked_prefill=inference.enable_chunked_prefill,
        enable_prefix_caching=inference.enable_prefix_caching, enforce_eager=inference.enforce_eager,
        free_cache_engine=False, prompt_length=inference.prompt_length + inference.response_length,
        response_length=1, seed=seed, load_format=inference.load_format or "auto", logprobs_mode="raw_logprobs",
        engine_kwargs={"vllm": {"disable_log_stats": inference.disable_log_stats,
                                "skip_tokenizer_init": inference.skip_tokenizer_init, **vllm_kwargs}})


def top_entries(position: dict, k: int) -> tuple[list[int], list[float]]:
    """The top k (by vLLM's rank) of one position's prompt log-probs {token id: Logprob}; vLLM adds the prompt's own
    token when it is not among them (rank > k), which is dropped, as verl does."""
    ranked = sorted(((entry.rank, token, entry.logprob) for token, entry in position.items() if entry.rank <= k),
                    key=lambda e: (e[0], -e[2]))[:k]
    if len(ranked) != k:
        raise RuntimeError(f"vLLM answered {len(ranked)} prompt log-probs of rank <= {k} at a position ({position})")
    return [int(token) for _, token, _ in ranked], [float(logprob) for _, _, logprob in ranked]


class TeacherServer(Worker):
    """One replica of one teacher in the teachers' own pool (module docstring). section: the distillation config;
    trust_remote_code: the student's (actor_rollout_ref.model.trust_remote_code), as the colocated teacher loads."""

    def __init__(self, section, trust_remote_code: bool = False):
        super().__init__()
        self.distillation, self.trust_remote_code = section, trust_remote_code
        self.name, self.teacher, self.replica = replica_of(section, self.rank)
        self.device = worker_device(self.local_rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        inference = self.teacher.inference
        if inference.name == "vllm":
            from pyrl.workers.rollout.vllm_engine import VLLMEngine  # lazy: vllm is optional

            topk = self.distillation.distillation_loss.topk or 0
            self.engine = VLLMEngine(self.teacher.model_path, teacher_engine_config(inference, topk, self.replica),
                                     self.device, own_workers=True, trust_remote_code=self.trust_remote_code)
            self.model = None
        else:
            from transformers import AutoModelForCausalLM  # lazy: transformers loads with the model

            from pyrl.workers.precision import runnable_dtype  # lazy: torch's dtype tables

            key = f"distillation.teacher_models.{self.name}.inference.dtype"
            self.engine = None
            self.model = AutoModelForCausalLM.from_pretrained(
                self.teacher.model_path, dtype=runnable_dtype(inference.dtype, key, self.device),
                trust_remote_code=self.trust_remote_code)
            self.model.to(self.device).eval().requires_grad_(False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> str:
        return f"{self.name} replica {self.replica} ({self.teacher.inference.name}, {self.teacher.model_path})"

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def score(self, sequences: list[list[int]], prompt_lengths: list[int], topk: int) -> list[tuple]:
        """Per sequence (prompt + response token ids) the scores of its response tokens (those after
        prompt_lengths[i]): with topk k > 0 (ids [r, k] int64, log-probs [r, k] float32), else (None, the sampled
        tokens' log-probs [r])."""
        if topk < 0 or (self.engine is not None and topk > (self.distillation.distillation_loss.topk or 0)):
            raise ValueError(f"teacher {self.name}: topk={topk}: 0 (the sampled tokens) up to distillation."
                             f"distillation_loss.topk={self.distillation.distillation_loss.topk} (vLLM's max_logprobs)")
        if not sequences:
            return []
        for i, (sequence, prompt) in enumerate(zip(sequences, prompt_lengths)):
            if not 1 <= prompt <= len(sequence):
                raise ValueError(f"teacher {self.name}: sequence {i} has {len(sequence)} tokens and a prompt of "
                                 f"{prompt}: a prompt of at least one token, within the sequence")
        if self.engine is not None:
            return self._vllm_scores(sequences, prompt_lengths, topk)
        return self._hf_scores(sequences, prompt_lengths, topk)

    def _vllm_scores(self, sequences, prompt_lengths, topk: int) -> list[tuple]:
        # lazy: vllm is optional
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=topk, detokenize=False)
        outputs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                           use_tqdm=False)
        out = []
        for sequence, prompt, output in zip(sequences, prompt_lengths, outputs):
            positions = output.prompt_logprobs[prompt:]  # position j: the log-probs of token j given those before
            if not topk:  # prompt_logprobs=0: the prompt's own token alone
                logp = [float(position[token].logprob) for token, position in zip(sequence[prompt:], positions)]
                out.append((None, torch.tensor(logp, dtype=torch.float32)))
                continue
            ids, logp = zip(*(top_entries(position, topk) for position in positions)) if positions else ((), ())
            out.append((torch.tensor(ids, dtype=torch.int64).reshape(-1, topk),
                        torch.tensor(logp, dtype=torch.float32).reshape(-1, topk)))
        return out

    @torch.no_grad()
    def _hf_scores(self, sequences, prompt_lengths, topk: int) -> list[tuple]:
        budget = self.teacher.inference.max_num_batched_tokens
        out, start = [], 0
        while start < len(sequences):  # consecutive sequences within the token budget (at least one)
            end = start + 1
            while end < len(sequences) and (end + 1 - start) * max(map(len, sequences[start:end + 1])) <= budget:
                end += 1
            chunk = sequences[start:end]
            width = max(map(len, chunk))
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, sequence in enumerate(chunk):  # right padding: the positions of real tokens are 0..L-1
                ids[i, :len(sequence)], mask[i, :len(sequence)] = torch.tensor(sequence), 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, sequence in enumerate(chunk):
                prompt = prompt_lengths[start + i]
                logp = logits[i, prompt - 1:len(sequence) - 1].float().log_softmax(-1)
                if topk:
                    values, top = logp.topk(topk, dim=-1)
                    out.append((top.cpu(), values.cpu()))
                else:
                    targets = torch.tensor(sequence[prompt:], device=logp.device)
                    out.append((None, logp.gather(-1, targets[:, None])[:, 0].cpu()))
            start = end
        return out


def spread(rows: list[int], tokens: list[int], servers: int) -> list[list[int]]:
    """rows over `servers` replicas, near-equal tokens each (longest first, to the least loaded)."""
    parts, loads = [[] for _ in range(servers)], [0] * servers
    for row in sorted(rows, key=lambda r: -tokens[r]):
        least = loads.index(min(loads))
        parts[least].append(row)
        loads[least] += tokens[row]
    return parts


def score_batch(group, distillation, data: DataProto) -> DataProto:
    """The teacher pass over the teachers' own pool (module docstring): the batch's rows (input_ids and
    attention_mask [B, P + R], the prompt left-padded and the response right-padded; responses [B, R]) scored by
    their teachers' servers (group: the TeacherServer group)."""
    responses = data.batch["responses"]
    rows, width = responses.shape
    mask = data.batch["attention_mask"].bool()
    prompt_width = mask.shape[1] - width
    sequences = [data.batch["input_ids"][i][mask[i]].tolist() for i in range(rows)]
    prompt_lengths = mask[:, :prompt_width].sum(-1).tolist()
    per_rank: list[list[int]] = [[] for _ in range(group.world_size)]
    routes = D.route_rows(distillation, D.teacher_keys_of(distillation, data))
    for routed, ranks in zip(routes, ranks_of(distillation)):
        for rank, part in zip(ranks, spread(routed, [len(s) for s in sequences], len(ranks))):
            per_rank[rank] = part
    topk = distillation.distillation_loss.topk if D.uses_topk(distillation.distillation_loss) else 0
    answers = group.score([[sequences[i] for i in part] for part in per_rank],
                          [[prompt_lengths[i] for i in part] for part in per_rank], [topk] * group.world_size)
    if topk:
        out = {"teacher_topk_log_probs": torch.zeros((rows, width, topk), dtype=torch.float32),
               "teacher_topk_ids": torch.zeros((rows, width, topk), dtype=torch.int64)}
    else:
        out = {"teacher_log_probs": torch.zeros((rows, width), dtype=torch.float32)}
    for part, scores in zip(per_rank, answers):
        for row, (ids, logp) in zip(part, scores):
            length = len(sequences[row]) - prompt_lengths[row]
            if logp.shape[0] != length:
                raise RuntimeError(f"teacher server answered {logp.shape[0]} positions for row {row}'s response of "
                                   f"{length} tokens")
            if topk:
                out["teacher_topk_log_probs"][row, :length] = logp
                out["teacher_topk_ids"][row, :length] = ids
            else:
                out["teacher_log_probs"][row, :length] = logp
    return DataProto.from_dict(out)
