"""The SFT -> RM -> PPO pipeline: config errors, the token/macro equivalence of an update, the
same PPO metrics on 8 devices as on 1, exact resume, and skipped non-finite updates."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax import pipeline as pipeline_lib
from marl_jax import stages
from marl_jax.macro import advantage, termination
from marl_jax.train import build, phases, ppo as ppo_lib, ppo_core as core, ppo_types, sharding
from marl_jax.train import supervised
from marl_jax.train.metrics import read_metrics

from train_util import tiny_config


def _ppo_rows(workdir, stage="ppo"):
    return [r for r in read_metrics(workdir) if r["stage"] == stage]


def _assert_rows_close(a, b, rtol, keys=None):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for k in keys or ra:
            if k.startswith("timing/") or k in ("tokens/s", "stage"):
                continue
            np.testing.assert_allclose(ra[k], rb[k], rtol=rtol, atol=rtol * 1e-2, err_msg=k)


# ---- config errors come before anything compiles -------------------------------------------
@pytest.mark.parametrize("field, value, match", [
    ("ppo.termination", "sentences", "config.ppo.termination"),
    ("ppo.ngram", 0, "config.ppo.ngram"),
    ("ppo.value_weighting", "median", "config.ppo.value_weighting"),
    ("stage", "dpo", "config.stage"),
    ("mesh.fsdp", 3, "config.mesh.fsdp"),
    ("ppo.num_minibatches", 3, "config.ppo.num_minibatches"),
    ("model.dtype", "fp8", "config.model.dtype='fp8'"),
    ("model.param_dtype", "auto", "config.model.param_dtype='auto'"),
])
def test_config_errors_name_the_field(tmp_path, field, value, match):
    cfg = tiny_config(**{field: value})
    with pytest.raises(ValueError, match=match):
        stages.run(cfg, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_batch_not_divisible_by_mesh_is_reported(tmp_path):
    cfg = tiny_config(**{"mesh.data": 8, "sft.batch_size": 12})
    with pytest.raises(ValueError, match="config.sft.batch_size=12"):
        stages.run(cfg, str(tmp_path))


# ---- MA-PPO with n = 1 is token PPO ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("tiny"))
    pipe = pipeline_lib.Pipeline(tiny_config(), workdir)
    sft = pipe.sft()
    rm, stats = pipe.rm()
    yield pipe, sft, rm, stats
    pipe.close()


@pytest.mark.smoke
def test_macro_update_with_n1_equals_token_update(tiny_pipeline):
    pipe, sft, rm, stats = tiny_pipeline
    cfg = pipe.config
    variants = tuple(("fixed", w, a) for w in advantage.VALUE_WEIGHTINGS
                     for a in advantage.REWARD_AGGREGATIONS)
    static = ppo_lib.static_from_config(cfg, pipe.task.tokenizer, variants=variants)
    mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model)
    critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, jax.random.key(0), stats)
    state = ppo_lib.initial_state(cfg, mods, sft, critic, seed=0)
    frozen = ppo_types.Frozen(sft, rm, jnp.float32(stats["mean"]), jnp.float32(stats["std"]))
    ids, mask = pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8]
    exp, _ = jax.jit(functools.partial(core.rollout, static, mods))(
        state, frozen, ids, mask, jax.random.key(1))
    # Without top-k / top-p the scoring pass reuses the sampler's logprobs: they must be the
    # training-time logprobs of the sampled tokens.
    assert ppo_types.sampler_logprobs_are_exact(static)
    recomputed, _ = phases.score.token_logprobs(pipe.policy, state.actor_params, exp.prompt_ids,
                                        exp.prompt_mask, exp.response_ids, exp.response_mask,
                                        static.temperature)
    np.testing.assert_allclose(np.asarray(exp.old_logprobs), np.asarray(recomputed), atol=2e-5)
    key = jax.random.key(2)
    update = jax.jit(functools.partial(phases.update.update, static, mods))
    segments = {"fixed": termination.fixed_ngram(exp.response_mask, 1)}
    advantages = lambda adv, ret: phases.advantages.Advantages(adv, ret, None, segments["fixed"])

    adv, ret = advantage.gae(exp.values, exp.rewards, exp.response_mask, gamma=1.0, lam=0.95)
    token_state, token_metrics = update(state, exp, advantages(adv, ret), key)
    for i in range(len(variants)):
        hp = ppo_types.RunHparams(lam=jnp.float32(0.95), gamma=jnp.float32(1.0),
                             ngram=jnp.int32(1), variant=jnp.int32(i))
        m_adv, m_ret = phases.advantages.advantages_and_returns(static, hp, exp, segments)
        macro_state, macro_metrics = update(state, exp, advantages(m_adv, m_ret), key)
        for a, b in zip(jax.tree.leaves(token_state.actor_params),
                        jax.tree.leaves(macro_state.actor_params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert float(macro_metrics["loss/policy_avg"]) == float(token_metrics["loss/policy_avg"])
    # The update really moved the actor.
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
        jax.tree.leaves(token_state.actor_params), jax.tree.leaves(state.actor_params))]
    assert max(moved) > 0


# ---- sharding: same metrics on an fsdp 4 x tensor 2 mesh as on one device -----------------
def test_eight_device_mesh_logs_the_same_metrics_as_one_device(tmp_path):
    assert jax.device_count() == 8
    one = pipeline_lib.Pipeline(tiny_config(), str(tmp_path / "one"))
    one.mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                                  devices=jax.devices()[:1])
    eight = pipeline_lib.Pipeline(tiny_config(**{"mesh.fsdp": 4, "mesh.tensor": 2}),
                                  str(tmp_path / "eight"))
    states = []
    for pipe in (one, eight):
        states.append(pipe.ppo())
        pipe.close()
    leaf = jax.tree.leaves(states[1].actor_params)[0]
    assert len(leaf.sharding.device_set) == 8
    for stage in ("sft", "rm", "ppo", "eval"):
        _assert_rows_close(_ppo_rows(tmp_path / "one", stage), _ppo_rows(tmp_path / "eight", stage),
                           rtol=2e-3)


# ---- resume: k steps, then the same command to 2k, equals 2k straight ----------------------
def test_resume_equals_straight_run(tmp_path):
    straight = str(tmp_path / "straight")
    split = str(tmp_path / "split")
    stages.run(tiny_config(**{"ppo.steps": 4}), straight)
    stages.run(tiny_config(**{"ppo.steps": 2}), split)
    sft_mtime = os.path.getmtime(os.path.join(split, "models", "sft", "config.json"))
    stages.run(tiny_config(**{"ppo.steps": 4}), split)
    # The finished SFT and RM stages are reused, not retrained or relogged.
    assert os.path.getmtime(os.path.join(split, "models", "sft", "config.json")) == sft_mtime
    assert len(_ppo_rows(split, "sft")) == len(_ppo_rows(straight, "sft"))
    _assert_rows_close(_ppo_rows(straight), _ppo_rows(split), rtol=1e-6)
    evals = {r["step"]: r for r in _ppo_rows(split, "eval")}
    for r in _ppo_rows(straight, "eval"):
        np.testing.assert_allclose(r["gold"], evals[r["step"]]["gold"], rtol=1e-6)


def test_later_stage_needs_the_earlier_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config.stage=sft"):
        stages.run(tiny_config(stage="rm"), str(tmp_path))


# ---- non-finite losses never reach the params ------------------------------------------------
def test_non_finite_loss_skips_the_update():
    params = {"w": jnp.ones((3,))}
    opt = optax.adamw(0.1)

    def loss_fn(p, batch):
        loss = jnp.sum(p["w"] * batch["x"])
        return loss, {}

    step = jax.jit(supervised.make_train_step(loss_fn, opt))
    state = build.TrainState(step=jnp.int32(0), params=params, opt_state=opt.init(params),
                             skipped_updates=jnp.float32(0))
    bad, m = step(state, {"x": jnp.array([1.0, jnp.nan, 0.0])})
    np.testing.assert_array_equal(np.asarray(bad.params["w"]), np.ones(3))
    assert float(m["skipped_updates"]) == 1.0
    chex_equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                              bad.opt_state, state.opt_state)
    assert all(jax.tree.leaves(chex_equal))
    good, m = step(bad, {"x": jnp.array([1.0, 1.0, 1.0])})
    assert float(m["skipped_updates"]) == 1.0
    assert np.all(np.asarray(good.params["w"]) < 1.0)


# ---- learning ----------------------------------------------------------------------------------
def test_ppo_raises_the_gold_score(tmp_path):
    """With the gold function as reward (an oracle RM) and a zero-initialised critic, 40 PPO
    steps lift the held-out gold score of the SFT policy."""
    cfg = tiny_config(**{"sft.steps": 400, "rm.steps": 10, "ppo.steps": 40, "ppo.batch_size": 16,
                         "ppo.eval_every": 40, "task.num_eval_prompts": 64,
                         "checkpoint_every": 1000, "ppo.learning_rate": 3e-4,
                         "ppo.reward_source": "gold", "ppo.critic_init": "sft"})
    stages.run(cfg, str(tmp_path))
    evals = _ppo_rows(tmp_path, "eval")
    assert [r["step"] for r in evals] == [0, 40]
    assert evals[1]["gold"] > evals[0]["gold"] + 0.05, evals


def test_reward_model_separates_good_from_bad_summaries(tmp_path):
    """Pairs whose chosen summary is ideal and rejected one picks the least important entities:
    the reward model ranks held-out pairs correctly."""
    from marl_jax.data import collate, synthetic as syn
    from marl_jax.train import reward

    cfg = tiny_config(**{"rm.steps": 150, "sft.steps": 0})
    pipe = pipeline_lib.Pipeline(cfg, str(tmp_path))
    task = syn.SyntheticTask(num_entities=8, num_words=8, doc_size=4, summary_items=2,
                             min_description=2, max_description=3)
    rng = np.random.default_rng(0)
    docs = syn.sample_documents(task, rng, 640)
    best = syn.ideal_summary(task, docs)
    order = np.argsort(-task.importance_rank[docs], axis=1)
    worst = np.take_along_axis(docs, order, axis=1)[:, :2]
    tok = pipe.task.tokenizer

    def encode(rows):
        p_ids, p_mask = collate.encode_prompts(tok, [syn.prompt_text(task, d) for d in docs[rows]],
                                               pipe.task.prompt_length)
        c_ids, c_mask = collate.encode_responses(
            tok, [syn.summary_text(task, s, eos=False) for s in best[rows]], 12)
        r_ids, r_mask = collate.encode_responses(
            tok, [syn.summary_text(task, s, eos=False) for s in worst[rows]], 12)
        return dict(prompt_ids=p_ids, prompt_mask=p_mask, chosen_ids=c_ids, chosen_mask=c_mask,
                    rejected_ids=r_ids, rejected_mask=r_mask)

    pipe.task.rm = encode(np.arange(512))
    params, stats = pipe.rm()
    held_out = encode(np.arange(512, 640))
    chosen, rejected = jax.jit(lambda p, b: reward.pair_scores(pipe.reward_model, p, b))(
        params, held_out)
    accuracy = float(np.mean(np.asarray(chosen) > np.asarray(rejected)))
    assert accuracy > 0.9, accuracy
    assert stats["std"] > 0
    pipe.close()
