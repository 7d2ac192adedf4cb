"""PPO at the settings of real-scale runs: minibatches, epochs and gradient accumulation keep the
schedule and the update; the critic starts on the normalised reward's scale; exports and reward
statistics follow the checkpoints; the synthetic reward model sees responses without EOS."""
import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import pipeline as pipeline_lib
from marl_jax import stages
from marl_jax.macro import termination
from marl_jax.train import exports, ppo as ppo_lib, phases, ppo_core as core, ppo_types
from marl_jax.train.metrics import read_metrics

from train_util import tiny_config, trained_tiny_pipeline


def _rows(workdir, stage):
    return [r for r in read_metrics(workdir) if r["stage"] == stage]


@pytest.fixture(scope="module")
def minibatch_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("minibatch"))
    cfg = tiny_config(**{"ppo.steps": 3, "ppo.num_minibatches": 4, "ppo.ppo_epochs": 2,
                         "ppo.schedule": "linear", "ppo.warmup_ratio": 0.2,
                         "ppo.grad_accum_steps": 2, "sft.grad_accum_steps": 2,
                         "rm.grad_accum_steps": 2, "sft.schedule": "linear",
                         "sft.warmup_ratio": 0.5})
    stages.run(cfg, workdir)
    return cfg, workdir


def test_learning_rate_of_every_update_is_logged_and_stays_positive(minibatch_run):
    cfg, workdir = minibatch_run
    p = cfg.ppo
    updates = p.steps * p.ppo_epochs * p.num_minibatches  # 24
    warmup = round(0.2 * updates)  # 5
    peak = p.learning_rate

    def linear(i):
        return peak * i / warmup if i < warmup else peak * (1 - (i - warmup) / (updates - warmup))

    rows = _rows(workdir, "ppo")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        first_update = (r["step"] - 1) * p.ppo_epochs * p.num_minibatches
        np.testing.assert_allclose(r["lr"], linear(first_update), rtol=1e-5)
        np.testing.assert_allclose(r["lr_critic"],
                                   linear(first_update) * p.critic_learning_rate / peak, rtol=1e-5)
    assert rows[-1]["lr"] > 0
    sft = _rows(workdir, "sft")
    np.testing.assert_allclose([r["lr"] for r in sft], [0.0, 0.5 * cfg.sft.learning_rate,
                                                        cfg.sft.learning_rate,
                                                        0.5 * cfg.sft.learning_rate], rtol=1e-5)
    assert all("lr" in r for r in _rows(workdir, "rm"))


def test_critic_from_the_reward_model_starts_on_the_normalised_scale(minibatch_run):
    _, workdir = minibatch_run
    first = _rows(workdir, "ppo")[0]
    assert first["critic/score_value_error"] < 1e-3
    # The reward model's raw scores are off the normalised scale: without the rescale the error
    # would be about the distance between the two.
    assert abs(first["objective/raw_scores"] - first["objective/scores"]) > 1e-2


def test_cold_critic_is_off_the_reward_scale(tmp_path):
    stages.run(tiny_config(**{"ppo.steps": 1, "ppo.critic_init": "random"}), str(tmp_path))
    first = _rows(tmp_path, "ppo")[0]
    # A zero head predicts 0: the error is the mean absolute normalised score.
    assert first["critic/score_value_error"] > 0.1


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gradient_accumulation_gives_the_same_ppo_update(tiny_pipe, aggregation):
    pipe, sft, rm, stats = tiny_pipe
    results = []
    for k in (1, 4):
        cfg = tiny_config(**{"ppo.grad_accum_steps": k, "ppo.num_minibatches": 2,
                             "ppo.loss_aggregation": aggregation})
        static = ppo_lib.static_from_config(cfg, pipe.task.tokenizer)
        mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model)
        critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, jax.random.key(0), stats)
        state = ppo_lib.initial_state(cfg, mods, sft, critic, seed=0)
        frozen = ppo_types.Frozen(sft, rm, jnp.float32(stats["mean"]), jnp.float32(stats["std"]))
        hp = ppo_lib.hparams_from_config(cfg.ppo)
        step = jax.jit(functools.partial(core.ppo_step, static, mods))
        results.append(step(state, frozen, hp, pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8]))
    (one, m_one), (acc, m_acc) = results
    for a, b in zip(jax.tree.leaves(one.actor_params), jax.tree.leaves(acc.actor_params)):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for a, b in zip(jax.tree.leaves(one.critic_params), jax.tree.leaves(acc.critic_params)):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for key in ("loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg"):
        np.testing.assert_allclose(m_one[key], m_acc[key], rtol=1e-4, atol=1e-6, err_msg=key)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree.leaves(one.actor_params), jax.tree.leaves(sft)))
    assert moved > 1e-5


def test_critic_from_sft_is_the_sft_backbone_under_a_fresh_head(tiny_pipe):
    from marl_jax.models import params as params_lib
    pipe, sft, rm, stats = tiny_pipe
    cfg = tiny_config(**{"ppo.critic_init": "sft"})
    key = jax.random.key(3)
    critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, key, stats)
    for a, b in zip(jax.tree.leaves(critic["backbone"]), jax.tree.leaves(sft["backbone"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Not the reward model's backbone (it trained every layer of the tiny model).
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(critic["backbone"]), jax.tree.leaves(rm["backbone"])))
    fresh = params_lib.init_params(pipe.critic, key)["head"]
    assert set(critic["head"]) == set(fresh)
    for name in fresh:
        np.testing.assert_array_equal(np.asarray(critic["head"][name]), np.asarray(fresh[name]))
    assert not np.array_equal(np.asarray(critic["head"]["kernel"]),
                              np.asarray(rm["head"]["kernel"]))


def test_whitened_advantages_leave_the_returns_unwhitened(tiny_pipe):
    pipe, sft, rm, stats = tiny_pipe
    cfg = tiny_config(**{"ppo.critic_init": "sft"})
    static = ppo_lib.static_from_config(cfg, pipe.task.tokenizer)
    mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model)
    critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, jax.random.key(0), stats)
    state = ppo_lib.initial_state(cfg, mods, sft, critic, seed=0)
    frozen = ppo_types.Frozen(sft, rm, jnp.float32(stats["mean"]), jnp.float32(stats["std"]))
    exp, _ = jax.jit(functools.partial(core.rollout, static, mods))(
        state, frozen, pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8], jax.random.key(1))
    hp = ppo_lib.hparams_from_config(cfg.ppo)
    segments = {"fixed": termination.fixed_ngram(exp.response_mask, 1)}
    plain_adv, plain_ret = phases.advantages.advantages_and_returns(
        dataclasses.replace(static, whiten_advantages=False), hp, exp, segments)
    adv, ret = phases.advantages.advantages_and_returns(
        dataclasses.replace(static, whiten_advantages=True), hp, exp, segments)
    mask = np.asarray(exp.response_mask) != 0
    plain = np.asarray(plain_adv, np.float64)[mask]
    np.testing.assert_allclose(np.asarray(adv)[mask],
                               (plain - plain.mean()) / plain.std(ddof=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[~mask], 0.0)
    # The critic regresses onto returns from the unwhitened advantages: A + V.
    np.testing.assert_array_equal(np.asarray(ret), np.asarray(plain_ret))
    np.testing.assert_allclose(np.asarray(ret)[mask],
                               (np.asarray(plain_adv) + np.asarray(exp.values))[mask], rtol=1e-5,
                               atol=1e-6)
    assert plain.std() > 0 and abs(plain.mean()) > 1e-3  # whitening changed something


def _export_params(path):
    from marl_jax import models
    _, params = models.load_pretrained(path, dtype=jnp.float32)
    return params


def test_extended_run_exports_the_extended_policy(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    stages.run(tiny_config(**{"ppo.steps": 4}), straight)
    stages.run(tiny_config(**{"ppo.steps": 2}), split)
    policy = os.path.join(split, "models", "policy")
    assert exports.read_export_info(policy)["checkpoint_step"] == 2
    two = _export_params(policy)
    stages.run(tiny_config(**{"ppo.steps": 4}), split)
    assert exports.read_export_info(policy)["checkpoint_step"] == 4
    four, want = _export_params(policy), _export_params(os.path.join(straight, "models", "policy"))
    for a, b in zip(jax.tree.leaves(four), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(four),
                                                          jax.tree.leaves(two))) > 1e-4
    assert not os.path.exists(policy + ".tmp") and not os.path.exists(policy + ".old")


def test_eval_refuses_an_export_of_another_checkpoint(tmp_path):
    workdir = str(tmp_path)
    stages.run(tiny_config(**{"ppo.steps": 2}), workdir)
    exports.check_export_current(workdir, "policy")
    info_file = os.path.join(workdir, "models", "policy", exports.EXPORT_INFO)
    with open(info_file) as f:
        info = json.load(f)
    info["checkpoint_step"] = 1
    with open(info_file, "w") as f:
        json.dump(info, f)
    with pytest.raises(ValueError, match=r"exported from step 1 \(checkpoint \d+\) but "
                                         r".*checkpoints/ppo holds step 2 \(checkpoint \d+\)"):
        stages.run(tiny_config(stage="eval", **{"eval.judge": "gold"}), workdir)
    # The same step from an earlier training of the stage (another checkpoint) is refused too.
    latest_id = exports.export_info(workdir, "policy")["checkpoint_id"]
    with open(info_file, "w") as f:
        json.dump(dict(info, checkpoint_step=2, checkpoint_id=str(int(latest_id) - 1)), f)
    with pytest.raises(ValueError, match=rf"exported from step 2 \(checkpoint {int(latest_id) - 1}"
                                         rf"\) but .*holds step 2 \(checkpoint {latest_id}\)"):
        exports.check_export_current(workdir, "policy")


def test_reward_statistics_follow_a_retrained_reward_model(tmp_path):
    workdir = str(tmp_path)
    pipe = pipeline_lib.Pipeline(tiny_config(), workdir)
    _, stats = pipe.rm()
    pipe.close()
    stats_file = os.path.join(workdir, "models", "rm", exports.REWARD_STATS)
    assert json.load(open(stats_file)) == stats
    first_id = exports.read_export_info(os.path.join(workdir, "models", "rm"))["checkpoint_id"]
    # A later run reuses them; without the export it recomputes them on the same pairs (the
    # ones sampled from the SFT policy included).
    for drop_export in (False, True):
        if drop_export:
            shutil.rmtree(os.path.join(workdir, "models", "rm"))
        pipe = pipeline_lib.Pipeline(tiny_config(), workdir)
        _, again = pipe.rm()
        pipe.close()
        np.testing.assert_allclose([again["mean"], again["std"]], [stats["mean"], stats["std"]],
                                   rtol=1e-6)
    # Retrain the reward model (same number of steps, another learning rate).
    shutil.rmtree(os.path.join(workdir, "checkpoints", "rm"))
    pipe = pipeline_lib.Pipeline(tiny_config(**{"rm.learning_rate": 3e-2}), workdir)
    _, new_stats = pipe.rm()
    pipe.close()
    assert new_stats != stats
    assert json.load(open(stats_file)) == new_stats
    info = exports.read_export_info(os.path.join(workdir, "models", "rm"))
    assert info == exports.export_info(workdir, "rm") and info["checkpoint_step"] == 4
    assert info["checkpoint_id"] != first_id


def test_a_rerun_after_a_crash_before_the_first_checkpoint_logs_each_step_once(tmp_path,
                                                                                monkeypatch):
    from marl_jax.train import loop

    cfg = tiny_config(**{"checkpoint_every": 100, "ppo.steps": 3})
    real_run = loop.run

    def run_and_crash(stage, *, step_fn, **kwargs):
        def killed_at_step_3(state, step):
            if stage.name == "ppo" and step == 2:
                raise KeyboardInterrupt("killed")
            return step_fn(state, step)
        return real_run(stage, step_fn=killed_at_step_3, **kwargs)

    monkeypatch.setattr(loop, "run", run_and_crash)
    with pytest.raises(KeyboardInterrupt):
        stages.run(cfg, str(tmp_path))
    assert [r["step"] for r in _rows(tmp_path, "ppo")] == [1, 2]
    monkeypatch.setattr(loop, "run", real_run)
    stages.run(cfg, str(tmp_path))
    assert [r["step"] for r in _rows(tmp_path, "ppo")] == [1, 2, 3]
    assert [r["step"] for r in _rows(tmp_path, "eval")] == [0, 2, 3]


def test_synthetic_reward_data_keeps_truncated_responses_without_eos(tiny_pipe):
    pipe = tiny_pipe[0]
    eos = pipe.task.tokenizer.eos_token_id
    # The generated pairs come first, then those sampled from the SFT policy.
    generated = pipe.config.task.num_pairs - len(pipe.task.policy_pair_prompts["ids"])
    rm = {k: v[:generated] for k, v in pipe.task.rm.items()}
    without = {}
    for side in ("chosen", "rejected"):
        ids, mask = rm[f"{side}_ids"], rm[f"{side}_mask"]
        without[side] = np.mean(ids[np.arange(len(ids)), mask.sum(axis=1) - 1] != eos)
    # A quarter of the candidates are corrupted, a third of those truncated (1/12 of all), and
    # annotators mostly reject them.
    assert 0.05 < (without["chosen"] + without["rejected"]) / 2 < 0.12, without
    assert without["rejected"] > 2 * without["chosen"], without
    assert len(pipe.task.rm["prompt_ids"]) == pipe.config.task.num_pairs
    sft_last = pipe.task.sft["response_ids"][np.arange(len(pipe.task.sft["response_ids"])),
                                              pipe.task.sft["response_mask"].sum(axis=1) - 1]
    assert np.all(sft_last == eos)


def test_annotator_labels_sampled_pairs_by_gold():
    from marl_jax.data import synthetic as syn

    task = syn.SyntheticTask(num_entities=8, num_words=8, doc_size=4, summary_items=2,
                             min_description=2, max_description=3)
    docs = syn.sample_documents(task, np.random.default_rng(0), 400)
    best = syn.ideal_summary(task, docs)
    worst = np.take_along_axis(docs, np.argsort(-task.importance_rank[docs], axis=1), axis=1)

    def tokens(summaries):
        rows = [[task.ids[w] for w in syn.summary_text(task, s).split()] for s in summaries]
        ids = np.zeros((len(rows), 16), np.int32)
        mask = np.zeros((len(rows), 16), np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return ids, mask

    good, bad = tokens(best), tokens(worst[:, :2])
    gap = syn.gold_score_tokens(task, docs, *good) - syn.gold_score_tokens(task, docs, *bad)
    a_wins = syn.label_sampled_pairs(task, 0, docs, *good, *bad)
    want = 1 / (1 + np.exp(-gap / task.annotator_temperature))
    assert abs(a_wins.mean() - want.mean()) < 0.03 and want.mean() > 0.9
    same = syn.label_sampled_pairs(task, 1, docs, *good, *good)
    assert 0.4 < same.mean() < 0.6


def test_policy_pairs_hold_the_policy_samples_ordered_by_the_labels(tiny_pipe):
    from marl_jax.train.reward import sample_policy_pairs

    pipe, sft = tiny_pipe[0], tiny_pipe[1]
    prompts = {k: v[:6] for k, v in pipe.task.policy_pair_prompts.items()}
    eos, pad = pipe.task.tokenizer.eos_token_id, pipe.task.tokenizer.pad_token_id
    sampler = dict(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, eos_id=eos,
                   pad_id=pad)
    first = sample_policy_pairs(pipe.policy, sft, prompts, lambda d, *x: np.ones(len(d), bool),
                                key=jax.random.key(0), sampler=sampler, batch_size=4)
    second = sample_policy_pairs(pipe.policy, sft, prompts, lambda d, *x: np.zeros(len(d), bool),
                                 key=jax.random.key(0), sampler=sampler, batch_size=4)
    np.testing.assert_array_equal(first["chosen_ids"], second["rejected_ids"])
    np.testing.assert_array_equal(first["rejected_mask"], second["chosen_mask"])
    np.testing.assert_array_equal(first["prompt_ids"], prompts["ids"])
    # Two different samples per prompt, right-padded after their EOS.
    assert np.any(first["chosen_ids"] != first["rejected_ids"])
    for ids, mask in ((first["chosen_ids"], first["chosen_mask"]),
                      (first["rejected_ids"], first["rejected_mask"])):
        lengths = mask.sum(axis=1)
        assert np.all(mask == (np.arange(12)[None] < lengths[:, None]))
        assert np.all(ids[mask == 0] == pad)
