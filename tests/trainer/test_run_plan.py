"""The RunPlan (pyrl.trainer.run_plan): what a config resolves to, checked against the keys that decide it, for the
run shapes pyrl supports: GRPO, PPO with a critic, a KL term, several epochs, bypass mode, a reward model, the
one-step-off rollout's own pool, several CPU ranks."""

import pytest
from trainer_helpers import SMALL, compose

from pyrl.trainer.run_plan import PASSES

CPU = ["trainer.n_gpus_per_node=0"]


def plan_of(*overrides, config_name="ppo_trainer"):
    from pyrl.ppo import resolve_settings

    config = compose(*SMALL, *CPU, *overrides, config_name=config_name)
    return resolve_settings(config), config


def test_grpo_on_policy_skips_the_old_log_prob_and_ref_passes():
    plan, config = plan_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                           "actor_rollout_ref.actor.ppo_epochs=1")
    assert [r.name for r in plan.roles] == ["actor", "rollout"]
    assert plan.passes == ("generate", "reward", "advantage", "update_actor", "push_weights")
    assert plan.actor_group == "actor_rollout"
    assert (plan.rows_per_step, plan.world_size, plan.rows_per_rank) == (32, 1, 32)
    assert plan.rollout_pool is None and plan.trainer_pool.device == "cpu"
    assert dict(plan.why)["old_log_prob"].startswith("skipped: on-policy") and plan.old_log_probs_from == "update"
    assert plan.seed == config.actor_rollout_ref.rollout.seed


def test_ppo_with_a_critic_and_a_kl_loss():
    plan, _ = plan_of("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    assert [r.name for r in plan.roles] == ["actor", "rollout", "ref", "critic"]
    assert plan.role("critic").trains and not plan.role("ref").trains
    assert plan.role("ref").group == plan.role("actor").group == "actor_rollout_ref"
    # the hybrid engine's one group hosts actor, rollout and ref; the critic is a group colocated on its bundles
    assert [(g.name, g.worker.rsplit(".", 1)[-1], g.roles) for g in plan.groups] == [
        ("actor_rollout_ref", "ActorRolloutRefWorker", ("actor", "rollout", "ref")),
        ("critic", "CriticWorker", ("critic",))]
    assert plan.group_of("rollout").name == "actor_rollout_ref" and plan.group_of("reward_model") is None
    critic = plan.group_of("critic")
    assert critic.section == "critic" and [a.key for a in critic.args] == ["actor_rollout_ref.rollout.n"]
    # two epochs (the toy preset's), mini-batches of 4 of 8 prompts: the old log-probs need their own pass
    assert plan.passes == tuple(p for p in PASSES if p != "teacher")
    assert "actor.ppo_epochs=2, ppo_mini_batch_size=4" in dict(plan.why)["old_log_prob"]


def test_distillation_adds_the_teacher_pass_in_the_actor_group():
    plan, _ = plan_of("distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=pyrl:tiny")
    assert plan.passes.index("teacher") == plan.passes.index("update_actor") - 2  # after ref's place, before adv
    assert "in the actor's workers" in dict(plan.why)["teacher"]
    actor = plan.group_of("actor")
    assert [a.key for a in actor.args[1:]] == ["distillation"]  # the worker gets the section, loads the teacher
    assert plan.teacher_pool is None and plan.group_of("teacher") is None
    # verl's pool (distillation.nnodes=1 x 8 devices): 4 tensor-parallel-2 replicas (tests/trainer/test_teacher_pool.py)
    pooled, _ = plan_of("distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=pyrl:tiny",
                        "distillation.nnodes=1")
    assert pooled.teacher_pool.world_size == 4 and "in the teachers' own pool" in dict(pooled.why)["teacher"]


def test_several_teachers_each_hold_their_weights_and_score_in_turn():
    """verl 0.9.1's multi-teacher entries (the default teacher_model dropped): the plan names each teacher and its
    key; the memory plan holds every teacher's weights beside the others and scores with one at a time."""
    from pyrl.trainer.memory_plan import Capacity, memory_plan_of

    plan, config = plan_of("distillation.enabled=true", "+distillation.teacher_models.a.model_path=pyrl:tiny",
                           "+distillation.teacher_models.a.key=pyrl/toy_addition",
                           "+distillation.teacher_models.b.model_path=pyrl:tiny-wide",
                           "+distillation.teacher_models.b.key=x",
                           "+distillation.teacher_models.b.inference.dtype=float32")
    why = dict(plan.why)["teacher"]
    assert "2 teachers score, each the rows whose data_source is its key (pyrl/toy_addition: " in why
    a, b = (config.distillation.teacher_models[name] for name in "ab")  # typed, the rollout's inference defaults
    assert (a.inference.name, a.inference.prompt_length, b.inference.dtype, b.inference.max_num_batched_tokens) == (
        config.actor_rollout_ref.rollout.name, config.actor_rollout_ref.rollout.prompt_length, "float32", 8192)
    with pytest.raises(ValueError, match=r"unknown config key: distillation.teacher_models.b.inference.bogus"):
        plan_of("distillation.enabled=true", "+distillation.teacher_models.b.key=x",
                "+distillation.teacher_models.b.inference.bogus=1")
    from pyrl.ppo import resolve_model_paths

    resolve_model_paths(config, plan)  # as the run does before the memory plan
    memory = memory_plan_of(config, plan, Capacity(10 ** 12, "test"))
    names = [p.name for p in memory.phases]
    assert names.index("teacher (a)") + 1 == names.index("teacher (b)")
    update = next(p for p in memory.phases if p.name == "update_actor")
    held = {t.name.split(" weights")[0] for t in update.resident if t.name.startswith("teacher")}
    assert held == {"teacher (a)", "teacher (b)"}


@pytest.mark.parametrize("overrides, needs", [
    (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward"),
    (["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
     "adv_estimator=optimal_token_baseline"),
])
def test_what_needs_the_old_log_probs_before_the_update(overrides, needs):
    plan, _ = plan_of("actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_epochs=1",
                      *overrides)
    assert plan.runs("old_log_prob")
    assert needs in dict(plan.why)["old_log_prob"]


def test_bypass_mode_takes_the_rollouts_log_probs():
    plan, _ = plan_of("algorithm.rollout_correction.bypass_mode=true",
                      "actor_rollout_ref.rollout.calculate_log_probs=true")
    assert not plan.runs("old_log_prob")
    assert "bypass_mode" in dict(plan.why)["old_log_prob"]
    assert plan.old_log_probs_from == "rollout"


def test_the_one_step_off_rollout_has_a_pool_of_its_own():
    plan, _ = plan_of("rollout.n_cpu_workers_per_node=2", "trainer.n_cpu_workers_per_node=2",
                      config_name="one_step_off_ppo_trainer")
    assert plan.rollout_pool is not None and plan.rollout_pool.world_size == 2
    assert plan.role("rollout").group == "rollout" and plan.role("rollout").pool == "rollout"
    assert plan.actor_group == "actor"
    rollout = plan.group_of("rollout")
    assert ((rollout.name, rollout.args, rollout.pool, rollout.distributed)
            == ("rollout", ("rollout",), "rollout", False))
    assert (plan.world_size, plan.rows_per_rank, plan.processes_per_node) == (2, 16, 4)
    text = plan.describe()
    assert "rollout pool: 1 node(s) x 2 process(es), CPU (gloo) each" in text
    assert "trainer pool: 1 node(s) x 2 process(es), CPU (gloo) each" in text


def test_a_reward_model_role_and_the_plan_as_logged():
    plan, _ = plan_of("reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny")
    assert plan.role("reward_model").model_key == "reward.reward_model.model_path"
    text = plan.describe()
    assert "role reward_model: reward.reward_model.model_path, frozen" in text
    assert "passes: generate -> reward -> " in text
    assert f"seeds: derived from actor_rollout_ref.rollout.seed={plan.seed}" in text


def test_each_pass_reads_its_own_micro_batch_keys():
    """The micro-batch plan of each pass comes from its own section's keys (the rollout's log_prob_use_dynamic_bsz,
    the reward model's micro_batch_size_per_gpu), with rows per rank from the pass's batch: what the memory plan
    counts and the start log shows."""
    plan, _ = plan_of("algorithm.adv_estimator=gae", "trainer.n_cpu_workers_per_node=2",
                      "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=300",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                      "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=2",
                      "reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny",
                      "reward_model.micro_batch_size_per_gpu=3")
    micro = {m.phase: m for r in plan.roles for m in r.micro}
    # 8 prompts x 4 samples over 2 ranks: 16 rows per rank; the actor's mini-batches 4 prompts, the critic's 2
    assert micro["old_log_prob"].dynamic and micro["old_log_prob"].budget == 300 and micro["old_log_prob"].rows == 16
    assert micro["old_log_prob"].knob == "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
    assert (micro["update_actor"].size, micro["update_actor"].rows, micro["update_actor"].trains) == (2, 8, True)
    assert (micro["update_critic"].size, micro["update_critic"].rows) == (4, 4)
    assert micro["reward_model"].size == 3 and micro["reward_model"].knob == "reward_model.micro_batch_size_per_gpu"
    assert plan.role("critic").fsdp == "critic.fsdp" and plan.role("rollout").fsdp is None
    assert "old_log_prob over 16 rows per rank, a token budget of 300 per micro-batch" in plan.describe()


def test_asking_for_what_the_plan_lacks_names_it():
    plan, _ = plan_of()
    with pytest.raises(KeyError, match="no critic role"):
        plan.role("critic")
    with pytest.raises(KeyError, match="unknown pass 'refs'"):
        plan.runs("refs")
    with pytest.raises(KeyError, match="unknown role 'critics'"):
        plan.group_of("critics")
    with pytest.raises(KeyError, match="the run has no rollout pool"):
        plan.pool("rollout")


def test_the_workers_are_found_by_role():
    from pyrl.trainer.workers import Workers

    plan, _ = plan_of("algorithm.adv_estimator=gae")
    groups = {g.name: object() for g in plan.groups}
    workers = Workers(groups, plan, pool=None)
    assert workers.actor is workers.rollout is groups["actor_rollout"] and workers.critic is groups["critic"]
    assert workers.ref is None and workers.reward_model is None and workers.teacher is None
    assert workers.world_size == 1
    with pytest.raises(AttributeError, match="no attribute or role 'judge'"):
        workers.judge


@pytest.mark.parametrize("loss_mode, recut", [("vanilla", True), ("clip_cov", False)])
def test_an_unset_update_on_cpu_runs_a_token_budget_unless_its_loss_reads_micro_batch_statistics(loss_mode, recut):
    """No micro-batch size and use_dynamic_bsz false (verl's defaults): a CPU worker cuts the update into budgets of
    batching.CPU_TOKEN_BUDGET tokens (the start-up block says so), except for a loss whose terms use statistics of
    its micro-batch (clip_cov), which runs as configured, all rows in one."""
    import re

    plan, _ = plan_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                      "actor_rollout_ref.actor.use_dynamic_bsz=false",
                      f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}")
    update = {m.phase: m for r in plan.roles for m in r.micro}["update_actor"]
    assert update.size is None and not update.dynamic and update.recut is recut
    text = plan.describe()
    default = ("a token budget of 4096 per micro-batch (the CPU default: actor_rollout_ref.actor."
               "ppo_micro_batch_size_per_gpu unset, use_dynamic_bsz false)")
    whole = re.search(r"update_actor over \d+ rows per rank, in one micro-batch", text)
    assert (default in text and not whole) if recut else (whole and default not in text)
