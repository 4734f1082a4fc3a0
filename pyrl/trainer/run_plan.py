"""The run's shape, resolved once from the config before any worker starts: which roles run (and in which worker
group, on which pool, training or not), which passes a step makes, the pools' shapes, each role's rows per rank and
micro-batches, and the seed every random stream derives from (pyrl.seeding). The placement (build_workers), the
memory plan, the start checks and the trainer read it; none of them decides these again.

    plan = resolve_run_plan(config)      # after pyrl.ppo.resolve_settings: the config's values are final
    log.info("%s", plan.describe())      # one block at start

A step makes the plan's passes in this order (pyrl.trainer.ppo_trainer.PPOTrainer.train_step):
generate -> reward -> old_log_prob -> ref -> teacher -> values -> advantage -> update_critic -> update_actor ->
push_weights
(a pass absent from the plan is skipped; `why` says why each ran or not).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyrl.config import generation_batch_size, is_on_policy

PASSES = ("generate", "reward", "old_log_prob", "ref", "teacher", "values", "advantage", "update_critic",
          "update_actor", "push_weights")
ROLE_NAMES = ("actor", "rollout", "ref", "critic", "reward_model")  # the roles a plan may hold
# a group's role that is no model role: distillation's teachers served from a pool of their own (their models are
# distillation.teacher_models', colocated they are the actor group's)
GROUP_ROLES = ROLE_NAMES + ("teacher",)


@dataclass(frozen=True)
class ConfigValue:
    """A worker constructor's argument read from the config when the group starts (after model paths resolve)."""
    key: str

    def read(self, config):
        value = config
        for part in self.key.split("."):
            value = getattr(value, part)
        return value


@dataclass(frozen=True)
class Pool:
    """Worker processes on `nnodes` nodes, `processes_per_node` each, one GPU each or none (CPU, gloo)."""
    name: str  # its config section: trainer, or rollout (the one-step-off rollout's own pool)
    nnodes: int
    processes_per_node: int
    gpus_per_process: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.processes_per_node

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_process else "cpu"

    def describe(self) -> str:
        each = f"{self.gpus_per_process} GPU" if self.gpus_per_process else "CPU (gloo)"
        return f"{self.name} pool: {self.nnodes} node(s) x {self.processes_per_node} process(es), {each} each"


@dataclass(frozen=True)
class MicroPlan:
    """How one pass of a role splits a rank's `rows` into micro-batches: `size` rows each (`size_key`; None: all in
    one), or with `dynamic` a budget of `budget` tokens each (`budget_key`); the keys live under `section`. The
    values are the config's, read when the plan is resolved."""
    step_pass: str  # the pass it serves (PASSES)
    phase: str  # its name in the memory plan's table
    section: str
    rows: int  # rows per rank the pass runs over
    size: int | None
    dynamic: bool
    budget: int | None
    size_key: str
    budget_key: str
    trains: bool = False  # forward and backward (an update), or forward only
    recut: bool = True  # batching.micro_batching's CPU default may apply (not to a loss of micro-batch statistics)

    @property
    def knob(self) -> str:
        """The key that sets its micro-batches' size."""
        return f"{self.section}.{self.budget_key if self.dynamic else self.size_key}"

    def describe(self, on_cpu: bool = False) -> str:
        from pyrl.workers.batching import micro_batching  # lazy: the plan reads without torch

        size, dynamic, budget = micro_batching(self.size, self.dynamic, self.budget, on_cpu, self.recut)
        split = (f"a token budget of {budget} per micro-batch" if dynamic
                 else f"{size} rows per micro-batch" if size else "in one micro-batch")
        if dynamic and not self.dynamic:
            split += f" (the CPU default: {self.section}.{self.size_key} unset, use_dynamic_bsz false)"
        return f"{self.phase} over {self.rows} rows per rank, {split}"


def micro_plan(config, step_pass: str, phase: str, section: str, rows: int, size_key: str, dynamic_key: str,
               budget_key: str, trains: bool = False, recut: bool = True) -> MicroPlan:
    values = ConfigValue(section).read(config)
    return MicroPlan(step_pass, phase, section, rows, getattr(values, size_key), bool(getattr(values, dynamic_key)),
                     getattr(values, budget_key), size_key, budget_key, trains, recut)


@dataclass(frozen=True)
class Role:
    """A model's part in the run: where it runs, what it holds, the passes it makes."""
    name: str  # actor, rollout, ref, critic, reward_model
    section: str  # its config section, for errors
    model_key: str  # the config key of its model
    trains: bool
    group: str  # the worker group that hosts it (the hybrid engine hosts actor, rollout and ref in one)
    pool: str  # the pool its group runs on
    kind: str = "causal_lm"  # its model's head: causal_lm (log-probs), token_classification (values),
    #                          sequence_classification (a score)
    model_of: str = ""  # the role whose model (architecture and settings) it runs: ref and rollout run the actor's
    fsdp: str | None = None  # the FSDP section its weights are sharded under; None: a rollout engine's
    owns_weights: bool = True  # False: it runs another role's weights (a LoRA reference: the actor, adapters off)
    micro: tuple[MicroPlan, ...] = ()  # its passes' micro-batches
    detail: str = ""  # anything else about how it runs (its engine)

    @property
    def model_section(self) -> str:
        """The config section of its model's settings (path, trust_remote_code, override_config, LoRA)."""
        return MODEL_SECTIONS[self.model_of or self.name]


MODEL_SECTIONS = {"actor": "actor_rollout_ref.model", "critic": "critic.model", "reward_model": "reward_model.model"}


@dataclass(frozen=True)
class Group:
    """A worker group: processes of `worker` (a dotted class path) on `pool`, each constructed as
    worker(<config section>, *args) (a ConfigValue argument read from the config at start); it hosts `roles`."""
    name: str  # the group's name in errors and placements
    worker: str
    section: str  # the config section the worker takes
    args: tuple = ()
    pool: str = "trainer"
    roles: tuple[str, ...] = ()
    distributed: bool = True  # a process group over its ranks (FSDP); the one-step-off rollout's needs one only for TP


@dataclass(frozen=True)
class RunPlan:
    trainer_pool: Pool
    rollout_pool: Pool | None  # None: the hybrid engine generates in the trainer's workers
    roles: tuple[Role, ...]
    groups: tuple[Group, ...]  # in start order: the trainer's pool's (colocated), then the rollout's
    passes: tuple[str, ...]  # in PASSES' order
    why: tuple[tuple[str, str], ...]  # (pass, why it runs or is skipped)
    rows_per_step: int  # samples trained on per step: data.train_batch_size x rollout.n
    prompts_per_step: int  # prompts generated for per step (more than trained on with dynamic sampling)
    seed: int  # actor_rollout_ref.rollout.seed: every sampling seed derives from it (pyrl.seeding)
    # where the old log-probs come from (old_log_prob_source): "pass", "rollout" (bypass mode), "update" (on-policy:
    # the update's own); "" for a run without them (generation, SFT)
    old_log_probs_from: str = ""
    # a served reward model's own pool (reward.reward_model.enable_resource_pool); None: none, or colocated
    reward_model_pool: Pool | None = None
    # distillation's teachers' own pool (distillation.n_gpus_per_node x nnodes); None: none, they score in the actor's
    # workers
    teacher_pool: Pool | None = None

    # ---- what the rest of the run asks ----
    def has(self, role: str) -> bool:
        return any(r.name == role for r in self.roles)

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"the run has no {name} role; its roles are {[r.name for r in self.roles]}")

    def model_roles(self) -> list[Role]:
        """The first role of each model the run loads (roles sharing a model section share the model's settings:
        the rollout and the reference run the actor's), in the plan's order."""
        first: dict[str, Role] = {}
        for r in self.roles:
            first.setdefault(r.model_section, r)
        return list(first.values())

    def group_of(self, role: str) -> Group | None:
        """The group hosting `role`, None when the run has no such role."""
        if role not in GROUP_ROLES:
            raise KeyError(f"unknown role {role!r}; the roles are {GROUP_ROLES}")
        return next((g for g in self.groups if role in g.roles), None)

    def runs(self, step_pass: str) -> bool:
        if step_pass not in PASSES:
            raise KeyError(f"unknown pass {step_pass!r}; the passes are {PASSES}")
        return step_pass in self.passes

    def pool(self, name: str) -> Pool:
        pool = {"trainer": self.trainer_pool, "rollout": self.rollout_pool, "reward_model": self.reward_model_pool,
                "teacher": self.teacher_pool}.get(name)
        if pool is None:
            raise KeyError(f"the run has no {name} pool")
        return pool

    def pools(self) -> tuple[Pool | None, ...]:
        """The trainer's, the one-step-off rollout's, the served reward model's, the teachers' (None where absent)."""
        return self.trainer_pool, self.rollout_pool, self.reward_model_pool, self.teacher_pool

    def own_pools(self) -> list[Pool]:
        """The pools of servers beside the trainer's (the served reward model's, the teachers'), placed after the
        others on what they leave free."""
        return [pool for pool in (self.reward_model_pool, self.teacher_pool) if pool is not None]

    @property
    def world_size(self) -> int:
        """The trainer's data-parallel ranks."""
        return self.trainer_pool.world_size

    @property
    def rows_per_rank(self) -> int:
        return self.rows_per_step // self.world_size

    @property
    def prompts_per_rank(self) -> int:
        """Prompts a trainer rank's hybrid engine generates for."""
        return self.prompts_per_step // self.world_size

    @property
    def prompts_per_rollout_process(self) -> int:
        """Prompts a process of the one-step-off rollout's pool generates for (the last may have fewer)."""
        return math.ceil(self.prompts_per_step / self.rollout_pool.world_size)

    @property
    def actor_group(self) -> str:
        """The actor's worker group's role string (ActorRolloutRefWorker's `role`): the roles it hosts."""
        return self.role("actor").group

    @property
    def processes_per_node(self) -> int:
        """Worker processes sharing a node's memory: the trainer's ranks, and on CPU the one-step-off rollout's
        processes beside them (on GPUs each has a device of its own)."""
        shared = self.rollout_pool is not None and self.trainer_pool.device == "cpu"
        return self.trainer_pool.processes_per_node + (self.rollout_pool.processes_per_node if shared else 0)

    def describe(self) -> str:
        lines = ["run plan:"]
        for pool in self.pools():
            if pool is not None:
                lines.append(f"  {pool.describe()}")
        lines.append(f"  rows: {self.rows_per_step} per step, {self.rows_per_rank} per trainer rank")
        for r in self.roles:
            on_cpu = self.pool(r.pool).device == "cpu"
            how = [m.describe(on_cpu) for m in r.micro] + ([r.detail] if r.detail else [])
            lines.append(f"  role {r.name}: {r.model_key}, {'trains' if r.trains else 'frozen'}, group {r.group} "
                         f"({r.pool} pool)" + "".join(f", {h}" for h in how))
        for g in self.groups:
            lines.append(f"  group {g.name}: {g.worker.rsplit('.', 1)[-1]} x {self.pool(g.pool).world_size} on the "
                         f"{g.pool} pool, hosting {', '.join(g.roles)}")
        lines.append(f"  passes: {' -> '.join(self.passes)}")
        for step_pass, why in self.why:
            lines.append(f"    {step_pass}: {why}")
        lines.append(f"  seeds: derived from actor_rollout_ref.rollout.seed={self.seed} (pyrl.seeding)")
        return "\n".join(lines)


# ---- resolving ----

def machine_gpus(trainer_config) -> int:
    """The GPUs this machine has, none unless trainer.device allows CUDA."""
    import torch  # lazy: torch stays off the config-check path until a GPU count is asked for

    return torch.cuda.device_count() if trainer_config.device in ("auto", "cuda") else 0


def gpus_per_node(trainer_config) -> int:
    """trainer.n_gpus_per_node; -1: the GPUs this machine has."""
    return trainer_config.n_gpus_per_node if trainer_config.n_gpus_per_node >= 0 else machine_gpus(trainer_config)


def _pool(name: str, section, gpus: int) -> Pool:
    """A pool from a section's nnodes and n_cpu_workers_per_node, with `gpus` GPUs per node (0: CPU workers)."""
    per_node = gpus if gpus > 0 else section.n_cpu_workers_per_node
    if per_node < 1:
        raise ValueError(f"{name}.n_cpu_workers_per_node must be >= 1 when the {name} runs on CPU "
                         f"({name}.n_gpus_per_node=0)")
    if section.nnodes < 1:
        raise ValueError(f"{name}.nnodes={section.nnodes}: the {name} needs at least one node")
    return Pool(name, section.nnodes, per_node, 1 if gpus > 0 else 0)


def trainer_pool(trainer_config) -> Pool:
    """The trainer's pool: a GPU per process, or trainer.n_cpu_workers_per_node CPU processes per node."""
    return _pool("trainer", trainer_config, gpus_per_node(trainer_config))


def rollout_pool(config) -> Pool | None:
    """The one-step-off rollout's own pool (actor_rollout_ref.hybrid_engine=false), from the top-level rollout
    section; None with the hybrid engine. rollout.n_gpus_per_node -1: the GPUs this machine has beyond
    trainer.n_gpus_per_node (none on a machine without GPUs: CPU workers)."""
    if config.actor_rollout_ref.hybrid_engine:
        return None
    section, trainer = config.rollout, config.trainer
    trainer_gpus = gpus_per_node(trainer)
    gpus = section.n_gpus_per_node
    if gpus < 0:
        machine = machine_gpus(trainer)
        gpus = machine - trainer_gpus if machine else 0
        if machine and gpus < 1:
            raise ValueError(f"rollout.n_gpus_per_node=-1 takes this machine's GPUs beyond trainer.n_gpus_per_node="
                             f"{trainer_gpus}, and it has {machine}: none are left for the rollout; set both keys")
    if (gpus > 0) != (trainer_gpus > 0):
        raise ValueError(f"rollout.n_gpus_per_node={section.n_gpus_per_node} and trainer.n_gpus_per_node="
                         f"{trainer.n_gpus_per_node}: the rollout and the trainer run both on GPUs or both on CPU")
    return _pool("rollout", section, gpus)


def serves_reward_model(config) -> bool:
    """The reward model runs behind a rollout engine (pyrl.workers.reward_server): reward.reward_model.rollout.name
    set; else pyrl's FSDP scorer runs it."""
    return config.reward.reward_model.enable and config.reward.reward_model.rollout.name is not None


def reward_model_pool(config) -> Pool | None:
    """A served reward model's own pool (reward.reward_model.enable_resource_pool): nnodes x n_gpus_per_node / TP
    server processes (rollout.tensor_model_parallel_size), TP GPUs each, or CPU processes when the trainer runs on CPU;
    None: colocated on the trainer's."""
    section = config.reward.reward_model
    if not serves_reward_model(config) or not section.enable_resource_pool:
        return None
    if section.nnodes < 1 or section.n_gpus_per_node < 1:
        raise ValueError(f"reward.reward_model.enable_resource_pool=true: its pool is reward.reward_model.nnodes="
                         f"{section.nnodes} x n_gpus_per_node={section.n_gpus_per_node} devices; both must be >= 1 "
                         "(verl: not enough GPUs to run the reward model)")
    tp = section.rollout.tensor_model_parallel_size
    if tp < 1 or section.n_gpus_per_node % tp:
        raise ValueError(f"reward.reward_model.rollout.tensor_model_parallel_size={tp} does not divide "
                         f"reward.reward_model.n_gpus_per_node={section.n_gpus_per_node}: each replica takes {tp} "
                         "devices of one node")
    on_gpu = gpus_per_node(config.trainer) > 0
    # a server process per replica, holding its TP devices (vLLM starts a worker on each)
    return Pool("reward_model", section.nnodes, section.n_gpus_per_node // tp, tp if on_gpu else 0)


def teacher_pool(config) -> Pool | None:
    """Distillation's teachers' own pool (distillation.n_gpus_per_node x nnodes): a server process per teacher
    replica, holding its devices (GPUs, or CPU processes when the trainer runs on CPU); None: no pool, the teachers
    score in the actor's workers. The replicas' layout is pyrl.algos.distillation.teacher_replicas'."""
    distillation = config.distillation
    if not distillation.enabled:
        return None
    from pyrl.algos.distillation import pool_devices, replica_devices, teachers_of  # lazy: the algorithms load torch

    if not pool_devices(distillation):
        return None
    size = replica_devices(teachers_of(distillation)[0][1])  # check_pool: every replica's
    on_gpu = gpus_per_node(config.trainer) > 0
    return Pool("teacher", distillation.nnodes, distillation.n_gpus_per_node // size, size if on_gpu else 0)


def estimator_needs(config):
    """What algorithm.adv_estimator declares it needs (pyrl.algos.registry.Needs)."""
    from pyrl.algos.advantage import ESTIMATORS  # lazy: pyrl.algos loads the ops (torch), not needed before here

    return ESTIMATORS.needs(config.algorithm.adv_estimator)


def uses_critic(config) -> bool:
    """critic.enable, or (None) exactly when the estimator reads values (gae)."""
    return config.critic.enable if config.critic.enable is not None else "values" in estimator_needs(config).tensors


def uses_ref(config) -> bool:
    """The reference model runs when a KL term needs it: in the loss (actor.use_kl_loss) or in the reward."""
    return config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward


def old_log_prob_source(config) -> tuple[str, str]:
    """("pass" | "rollout" | "update", why): where the old log-probs come from. The rollout engine's in verl's
    bypass mode; the update's own (taken before its optimizer step) when each sample gets exactly one optimizer
    step and nothing needs them before the update (the KL in the reward, the optimal token baseline's
    sum_pi_squared, rollout correction's IS weights or rejection); otherwise the old-log-prob forward pass."""
    algorithm, actor, n = config.algorithm, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout.n
    correction = algorithm.rollout_correction
    if correction.bypass_mode:
        return "rollout", "algorithm.rollout_correction.bypass_mode: the rollout engine's log-probs are the old ones"
    if not is_on_policy(actor, n, config.data.train_batch_size * n):
        return "pass", (f"runs: actor.ppo_epochs={actor.ppo_epochs}, ppo_mini_batch_size={actor.ppo_mini_batch_size}"
                        f" of data.train_batch_size={config.data.train_batch_size}: several optimizer steps per sample")
    needs = [what for what, on in (("algorithm.use_kl_in_reward", algorithm.use_kl_in_reward),
                                   (f"adv_estimator={algorithm.adv_estimator}",
                                    estimator_needs(config).old_log_probs_before_update),
                                   ("rollout_correction.rollout_is", bool(correction.rollout_is)),
                                   ("rollout_correction.rollout_rs", bool(correction.rollout_rs))) if on]
    if needs:
        return "pass", f"runs: {', '.join(needs)} needs the old log-probs before the update"
    return "update", ("skipped: on-policy (one epoch, one mini-batch), the update's own log-probs, taken before its "
                      "optimizer step, are the old ones")


def resolve_run_plan(config) -> RunPlan:
    """The plan of `config` (its settings resolved: pyrl.ppo.resolve_settings)."""
    from pyrl.algos.policy_loss import uses_micro_batch_statistics  # lazy: the plan's module reads without torch

    arr = config.actor_rollout_ref
    trainer, rollout = trainer_pool(config.trainer), rollout_pool(config)
    ref, critic, rm = uses_ref(config), uses_critic(config), config.reward.reward_model.enable
    world, n = trainer.world_size, arr.rollout.n
    step_rows = config.data.train_batch_size * n // world
    prompts = generation_batch_size(config.data)
    hosted = "actor" + ("_rollout" if rollout is None else "") + ("_ref" if ref else "")
    actor_fsdp = "actor_rollout_ref.actor.fsdp_config"

    def micro(*args, **kwargs):
        return micro_plan(config, *args, **kwargs)

    def log_probs(step_pass, phase, section):
        return micro(step_pass, phase, section, step_rows, "log_prob_micro_batch_size_per_gpu",
                     "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")

    roles = [Role("actor", "actor_rollout_ref.actor", "actor_rollout_ref.model", True, hosted, "trainer",
                  model_of="actor", fsdp=actor_fsdp, micro=(
                      log_probs("old_log_prob", "old_log_prob", "actor_rollout_ref.rollout"),
                      micro("update_actor", "update_actor", "actor_rollout_ref.actor",
                            arr.actor.ppo_mini_batch_size * n // world, "ppo_micro_batch_size_per_gpu",
                            "use_dynamic_bsz", "ppo_max_token_len_per_gpu", trains=True,
                            recut=not uses_micro_batch_statistics(arr.actor)))),
             Role("rollout", "actor_rollout_ref.rollout", "actor_rollout_ref.model", False,
                  hosted if rollout is None else "rollout", "trainer" if rollout is None else "rollout",
                  model_of="actor", detail=f"engine {arr.rollout.name}, tensor parallel "
                                           f"{arr.rollout.tensor_model_parallel_size}")]
    if ref:
        lora = arr.model.lora_rank > 0  # the actor with its adapters off: no model, no ref.fsdp_config of its own
        roles.append(Role("ref", "actor_rollout_ref.ref", "actor_rollout_ref.model", False, hosted, "trainer",
                          model_of="actor", fsdp=actor_fsdp if lora else "actor_rollout_ref.ref.fsdp_config",
                          owns_weights=not lora, micro=(log_probs("ref", "ref_log_prob", "actor_rollout_ref.ref"),),
                          detail="LoRA: the actor with its adapters off (no model of its own, ref.fsdp_config "
                                 "unused)" if lora else ""))
    if critic:
        roles.append(Role("critic", "critic", "critic.model", True, "critic", "trainer", "token_classification",
                          fsdp="critic.fsdp", micro=(
                              micro("values", "values", "critic", step_rows, "forward_micro_batch_size_per_gpu",
                                    "use_dynamic_bsz", "forward_max_token_len_per_gpu"),
                              micro("update_critic", "update_critic", "critic",
                                    config.critic.ppo_mini_batch_size * n // world, "ppo_micro_batch_size_per_gpu",
                                    "use_dynamic_bsz", "ppo_max_token_len_per_gpu", trains=True))))
    served = serves_reward_model(config)
    rm_pool = reward_model_pool(config)
    if served:  # behind its engine, reached over HTTP by the reward step
        section = config.reward.reward_model
        roles.append(Role("reward_model", "reward.reward_model", "reward.reward_model.model_path", False,
                          "reward_model_server", "reward_model" if rm_pool else "trainer", "served",
                          detail=f"served by {section.rollout.name}, "
                                 + ("its own pool" if rm_pool else "colocated on the trainer's pool")
                                 + f", tensor parallel {section.rollout.tensor_model_parallel_size}"))
    elif rm:  # it scores every generated sample, before dynamic sampling keeps some
        roles.append(Role("reward_model", "reward.reward_model", "reward.reward_model.model_path", False,
                          "reward_model", "trainer", "sequence_classification", fsdp="reward_model.fsdp_config",
                          micro=(micro("reward", "reward_model", "reward_model", prompts * n // world,
                                       "micro_batch_size_per_gpu", "use_dynamic_bsz",
                                       "forward_max_token_len_per_gpu"),)))
    source, old_why = old_log_prob_source(config)
    why = [("old_log_prob", old_why),
           ("ref", "runs: " + ("actor.use_kl_loss" if arr.actor.use_kl_loss else "algorithm.use_kl_in_reward")
            if ref else "skipped: no KL term (actor.use_kl_loss and algorithm.use_kl_in_reward are false)")]
    if critic:
        why.append(("values", f"runs: critic.enable={config.critic.enable} (adv_estimator="
                              f"{config.algorithm.adv_estimator})"))
    if rm:
        why.append(("reward", "reward model scores, then the reward function (reward.reward_model.enable)"))
    teacher = config.distillation.enabled
    if teacher:
        from pyrl.algos.distillation import teacher_placement, teachers_of  # lazy: the algorithms load torch

        teachers = teachers_of(config.distillation)
        loss = config.distillation.distillation_loss
        if len(teachers) == 1:
            who = f"the teacher ({teachers[0][1].model_path}, distillation.teacher_models.{teachers[0][0]}) scores"
        else:
            who = (f"{len(teachers)} teachers score, each the rows whose {config.distillation.teacher_key} is its key ("
                   + ", ".join(f"{t.key}: {t.model_path}" for _, t in teachers) + "),")
        why.append(("teacher", f"runs: distillation.enabled, {who} the responses "
                               f"{teacher_placement(config.distillation)} for loss_mode={loss.loss_mode}"
                               + (f" (top {loss.topk})" if loss.loss_mode == "forward_kl_topk" else "")))
    teachers_pool = teacher_pool(config)
    passes = [p for p in PASSES
              if (p != "old_log_prob" or source == "pass") and (p != "ref" or ref) and (p != "teacher" or teacher)
              and (p not in ("values", "update_critic") or critic)]
    groups = groups_of(roles, arr.rollout.tensor_model_parallel_size)
    if served and not rm_pool and config.reward.reward_model.rollout.tensor_model_parallel_size > 1:
        # colocated tensor-parallel replicas: each leader learns its group's devices from the others
        groups = tuple(dataclasses.replace(g, distributed=True) if g.name == "reward_model_server" else g
                       for g in groups)
    if teachers_pool is not None:
        worker, section, *args = GROUP_WORKERS["teacher_server"]
        groups += (Group("teacher_server", worker, section, tuple(args), "teacher", ("teacher",), distributed=False),)
    return RunPlan(trainer, rollout, tuple(roles), groups, tuple(passes), tuple(why),
                   config.data.train_batch_size * n, prompts, arr.rollout.seed, source, rm_pool, teachers_pool)


def resolve_generation_plan(config) -> RunPlan:
    """Batch generation's plan (pyrl.trainer.main_generation_server): the rollout role alone, one engine per
    trainer rank (or tensor-parallel group) of the trainer's pool, one pass."""
    arr = config.actor_rollout_ref
    trainer, n = trainer_pool(config.trainer), arr.rollout.n
    role = Role("rollout", "actor_rollout_ref.rollout", "actor_rollout_ref.model", False, "rollout", "trainer",
                model_of="actor", detail=f"engine {arr.rollout.name}, tensor parallel "
                                         f"{arr.rollout.tensor_model_parallel_size}")
    prompts = generation_batch_size(config.data)
    why = (("generate", f"runs: the prompts of data.train_files in calls of {prompts}, {n} sample(s) each, to "
                        f"data.output_path"),)
    return RunPlan(trainer, None, (role,), groups_of([role], arr.rollout.tensor_model_parallel_size), ("generate",),
                   why, prompts * n, prompts, arr.rollout.seed)


def sft_run_plan(config) -> RunPlan:
    """Supervised fine-tuning's plan (pyrl.trainer.sft_trainer, its keys as a PPO config: pyrl.trainer.sft_trainer.
    ppo_config_of): the actor role alone on the trainer's pool, one update pass per step."""
    arr, trainer = config.actor_rollout_ref, trainer_pool(config.trainer)
    rows = config.data.train_batch_size
    role = Role("actor", "actor_rollout_ref.actor", "model", True, "actor", "trainer", model_of="actor",
                fsdp="actor_rollout_ref.actor.fsdp_config",
                micro=(micro_plan(config, "update_actor", "update_actor", "actor_rollout_ref.actor",
                                  rows // trainer.world_size, "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                                  "ppo_max_token_len_per_gpu", trains=True),),
                detail=f"LoRA rank {arr.model.lora_rank}" if arr.model.lora_rank else "")
    why = (("update_actor", f"runs: {rows} conversations per step, the loss on their assistant tokens"),)
    return RunPlan(trainer, None, (role,), groups_of([role], 1), ("update_actor",), why, rows, 0, 0)


GROUP_NAME = object()  # a worker's argument: the name of its group (ActorRolloutRefWorker's role: the roles it hosts)

# the worker class of a group whose first role is the key, its config section, and the arguments that follow it
WORKERS = {
    "actor": ("pyrl.workers.actor.ActorRolloutRefWorker", "actor_rollout_ref", GROUP_NAME,
              ConfigValue("distillation")),
    "rollout": ("pyrl.workers.actor.ActorRolloutRefWorker", "actor_rollout_ref", GROUP_NAME),
    "critic": ("pyrl.workers.critic.CriticWorker", "critic", ConfigValue("actor_rollout_ref.rollout.n")),
    "reward_model": ("pyrl.workers.reward_model.RewardModelWorker", "reward_model",
                     ConfigValue("actor_rollout_ref.model.path")),
}
# a group whose name is here is made by its entry instead (the served reward model's role runs in server processes)
GROUP_WORKERS = {"reward_model_server": ("pyrl.workers.reward_server.RewardModelServer", "reward.reward_model"),
                 "teacher_server": ("pyrl.workers.teacher_server.TeacherServer", "distillation",
                                    ConfigValue("actor_rollout_ref.model.trust_remote_code"))}


def groups_of(roles: list[Role], rollout_tensor_parallel: int) -> tuple[Group, ...]:
    """The worker groups hosting `roles`, one per Role.group, in the roles' order: a group is made by the WORKERS
    entry of its first role (a GROUP_NAME argument: the group's name). The
    trainer's groups form process groups (FSDP); the one-step-off rollout's only to share tensor-parallel engines."""
    groups: dict[str, list[Role]] = {}
    for r in roles:
        groups.setdefault(r.group, []).append(r)
    out = []
    for name, members in groups.items():
        worker, section, *args = GROUP_WORKERS.get(name) or WORKERS[members[0].name]
        args = tuple(name if a is GROUP_NAME else a for a in args)
        distributed = name not in GROUP_WORKERS and (members[0].pool == "trainer" or rollout_tensor_parallel > 1)
        out.append(Group(name, worker, section, args, members[0].pool, tuple(r.name for r in members),
                         distributed=distributed))
    return tuple(out)
