"""Reward-model scores of preference pairs (each distinct sequence once), the reward model
that trains its top layers on its frozen trunk's states (the same scores, loss, gradients and
trained params as the full model), and the held-out evaluation with several samples per
prompt."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import models
from marl_jax.config import base_config
from marl_jax.models import last_token_score
from marl_jax.train import metrics, optim, sharding
from marl_jax.train import ppo as ppo_lib
from marl_jax.train import reward


def _reward_model(num_layers=2):
    cfg = models.ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_layers=num_layers, num_heads=2, num_kv_heads=2, head_dim=8,
                             max_position_embeddings=16, eos_token_id=(1,), pad_token_id=0)
    module = models.ScalarHeadModel(cfg, head_init_std=1.0)
    return module, models.init_params(module, jax.random.key(0))


def _pairs_sharing_responses(rng, prompts=3, k=3, p=3, r=4):
    """Every pair (a, b), a < b, of k samples of each prompt, as the review task cuts them."""
    prompt_ids = rng.integers(2, 32, (prompts, p)).astype(np.int32)
    prompt_mask = np.ones((prompts, p), np.int32)
    prompt_mask[0, 0] = 0  # a left-padded prompt
    ids = rng.integers(2, 32, (prompts, k, r)).astype(np.int32)
    mask = np.ones((prompts, k, r), np.int32)
    mask[:, 1, -1] = 0
    rows = [(i, a, b) for i in range(prompts) for a in range(k) for b in range(a + 1, k)]
    i, a, b = (np.array(x) for x in zip(*rows))
    return dict(prompt_ids=prompt_ids[i], prompt_mask=prompt_mask[i], chosen_ids=ids[i, a],
                chosen_mask=mask[i, a], rejected_ids=ids[i, b], rejected_mask=mask[i, b])


def _one_sequence_score(module, params, prompt_ids, prompt_mask, response_ids, response_mask):
    ids = jnp.asarray(np.concatenate([prompt_ids, response_ids])[None])
    mask = jnp.asarray(np.concatenate([prompt_mask, response_mask])[None])
    return float(last_token_score(module.apply({"params": params}, ids, mask), mask)[0])


def test_pair_scores_score_each_distinct_sequence_once_and_equal_one_by_one_scores():
    module, params = _reward_model()
    data = _pairs_sharing_responses(np.random.default_rng(0))
    n = len(data["prompt_ids"])  # 3 prompts x 3 pairs, 9 distinct responses in 18 slots
    traced, scored = [], []
    apply = module.apply

    class Recording:
        def apply(self, variables, ids, mask, rngs=None):
            assert rngs is None  # scoring runs without the adapters' dropout
            traced.append(ids.shape)
            jax.debug.callback(lambda x: scored.append(np.asarray(x)), ids)
            return apply(variables, ids, mask)

    chosen, rejected = reward.all_pair_scores(Recording(), params, data, batch_size=2)
    # 9 distinct sequences in batches of 2 x 2 rows: one compile, three batches (the last
    # padded with its final sequence), each distinct sequence in them once.
    jax.effects_barrier()
    assert traced == [(4, 7)]
    rows = np.concatenate(scored)
    assert rows.shape == (12, 7) and len(np.unique(rows, axis=0)) == 9
    for j in range(n):
        for side, got in (("chosen", chosen), ("rejected", rejected)):
            want = _one_sequence_score(module, params, data["prompt_ids"][j],
                                       data["prompt_mask"][j], data[f"{side}_ids"][j],
                                       data[f"{side}_mask"][j])
            np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)
    # A pair's two responses of one prompt are distinct sequences with distinct scores.
    assert np.all(chosen != rejected)
    # max_rows: the first pairs only, the same numbers.
    c2, r2 = reward.all_pair_scores(module, params, data, batch_size=3, max_rows=4)
    np.testing.assert_allclose(c2, chosen[:4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r2, rejected[:4], rtol=1e-5, atol=1e-6)
    # The statistics weight a response by the pairs it is in, as the pairs' scores do.
    stats = reward.reward_stats(module, params, data, batch_size=2)
    both = np.concatenate([chosen, rejected])
    np.testing.assert_allclose([stats["mean"], stats["std"]], [both.mean(), both.std()],
                               rtol=1e-5)


def test_frozen_trunk_layers_counts_the_layers_below_the_trained_ones():
    _, params = _reward_model(num_layers=3)
    assert [reward.frozen_trunk_layers(params, n) for n in (-1, 0, 1, 2, 3, 5)] == \
        [0, 3, 2, 1, 0, 0]
    scanned = dict(params, backbone=dict(layers={}, embed_tokens={}))
    assert reward.frozen_trunk_layers(scanned, 1) == 0


def test_trunk_scores_equal_full_model_scores_one_sequence_at_a_time():
    module, params = _reward_model(num_layers=3)
    data = _pairs_sharing_responses(np.random.default_rng(0))
    trunk = reward.pair_trunk(module, params, data, 2, batch_size=2)
    # 3 prompts x 3 samples: 9 distinct sequences in 18 pair slots.
    assert trunk.states.shape == (9, 7, 16) and trunk.num_pairs == 9
    chosen, rejected = reward.all_pair_scores(module, params, data, batch_size=2, trunk=trunk)
    for j in range(trunk.num_pairs):
        for side, got in (("chosen", chosen), ("rejected", rejected)):
            want = _one_sequence_score(module, params, data["prompt_ids"][j], data["prompt_mask"][j],
                               data[f"{side}_ids"][j], data[f"{side}_mask"][j])
            np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)
    stats = reward.reward_stats(module, params, data, batch_size=2, trunk=trunk)
    both = np.concatenate([chosen, rejected])
    np.testing.assert_allclose([stats["mean"], stats["std"]], [both.mean(), both.std()],
                               rtol=1e-5)
    with pytest.raises(ValueError, match="trunk states are of 9 pairs, the data has 4"):
        reward.all_pair_scores(module, params, {k: v[:4] for k, v in data.items()},
                               batch_size=2, trunk=trunk)


def test_trunk_loss_and_gradients_equal_the_full_models():
    module, params = _reward_model(num_layers=3)
    data = _pairs_sharing_responses(np.random.default_rng(1))
    trunk = reward.pair_trunk(module, params, data, 2, batch_size=4)
    rows = np.array([0, 4, 8, 2])
    batch = {k: jnp.asarray(v[rows]) for k, v in trunk.training_data(data).items()}
    full = optim.with_frozen_leaves(lambda p, b: reward.rm_loss(module, p, b), 1)
    top = lambda p, b: reward.rm_loss_from_trunk(module, 2, p, b)
    (want, want_metrics), want_grads = jax.value_and_grad(full, has_aux=True)(params, batch)
    (got, got_metrics), got_grads = jax.value_and_grad(top, has_aux=True)(params, batch)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_metrics["accuracy"], want_metrics["accuracy"])
    trained = optim.trainable_mask(params, 1)
    for (path, g), w, t in zip(jax.tree_util.tree_flatten_with_path(got_grads)[0],
                               jax.tree.leaves(want_grads), jax.tree.leaves(trained)):
        if t:
            assert np.abs(np.asarray(w)).max() > 0, path
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6, err_msg=str(path))


def test_run_rm_on_trunk_states_trains_the_same_params(tmp_path):
    module, init = _reward_model(num_layers=3)
    init = jax.tree.map(np.asarray, init)  # host arrays: each run gets its own device copy
    data = _pairs_sharing_responses(np.random.default_rng(2))
    config = base_config()
    config.rm.update(dict(steps=4, batch_size=8, learning_rate=1e-2, warmup_ratio=0.0,
                          num_layers_unfrozen=1))
    config.checkpoint_every = 1000
    mesh = sharding.make_mesh(config.mesh)
    task = types.SimpleNamespace(rm=data)
    out = {}
    for name, trunk in (("full", None), ("trunk", reward.pair_trunk(module, init, data, 2,
                                                                    batch_size=4))):
        workdir = str(tmp_path / name)
        writer = metrics.MetricsWriter(workdir, tensorboard=False)
        out[name] = reward.run_rm(config, task, module, init, mesh=mesh, writer=writer,
                                  workdir=workdir, trunk=trunk)
        writer.close()
    moved = 0.0
    for a, b, c in zip(jax.tree.leaves(out["full"]), jax.tree.leaves(out["trunk"]),
                       jax.tree.leaves(init)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        moved = max(moved, float(np.abs(np.asarray(a) - np.asarray(c)).max()))
    assert moved > 1e-3  # the top layers trained
    # A trunk reaching into the trained layers, or of other pairs, is refused.
    deep = reward.pair_trunk(module, init, data, 3, batch_size=4)
    with pytest.raises(ValueError, match="trunk of 3 layers and 9 pairs: the stage freezes 2"):
        reward.run_rm(config, task, module, init, mesh=mesh, writer=None,
                      workdir=str(tmp_path / "deep"), trunk=deep)


def _pairs_with_a_lone_pair(rng):
    """3 prompts x 3 samples (every pair) and a fourth prompt with one pair, the chosen and
    rejected sides of the first prompts' pairs swapped in places (annotator labels)."""
    data = _pairs_sharing_responses(rng)
    swap = np.array([1, 0, 0, 0, 1, 0, 1, 0, 0], bool)
    for side in ("ids", "mask"):
        c, r = data[f"chosen_{side}"].copy(), data[f"rejected_{side}"].copy()
        data[f"chosen_{side}"] = np.where(swap[:, None], r, c)
        data[f"rejected_{side}"] = np.where(swap[:, None], c, r)
    lone = dict(prompt_ids=rng.integers(2, 32, (1, 3)), prompt_mask=np.ones((1, 3)),
                chosen_ids=rng.integers(2, 32, (1, 4)), chosen_mask=np.ones((1, 4)),
                rejected_ids=rng.integers(2, 32, (1, 4)), rejected_mask=np.ones((1, 4)))
    return {k: np.concatenate([data[k], lone[k].astype(np.int32)]) for k in data}


def test_prompt_groups_hold_each_prompts_responses_once_and_every_pair():
    data = _pairs_with_a_lone_pair(np.random.default_rng(3))
    groups = reward.prompt_groups(data)
    # 4 prompts in order of their first pair; at most 3 responses and 3 pairs a prompt.
    assert groups.sequences.shape == (4, 3) and groups.win.shape == (4, 3)
    np.testing.assert_array_equal(groups.pair_mask, [[1, 1, 1]] * 3 + [[1, 0, 0]])
    assert groups.num_pairs == 10
    rows = groups.training_data(data)
    assert rows["response_ids"].shape == (4, 3, 4)
    # Every pair, rebuilt from its group's slots, is an input pair with the same label.
    rebuilt = []
    for g in range(4):
        np.testing.assert_array_equal(rows["prompt_ids"][g], data["prompt_ids"][min(3 * g, 9)])
        for j in range(3):
            if groups.pair_mask[g, j]:
                w, lose = groups.win[g, j], groups.lose[g, j]
                rebuilt.append((g, tuple(rows["response_ids"][g, w]),
                                tuple(rows["response_ids"][g, lose])))
    want = [(min(i // 3, 3), tuple(data["chosen_ids"][i]), tuple(data["rejected_ids"][i]))
            for i in range(10)]
    assert sorted(rebuilt) == sorted(want)
    # The lone pair's group repeats its first response in the unused slot.
    assert groups.sequences[3, 2] == groups.sequences[3, 0]


def test_grouped_loss_and_gradients_equal_the_pair_loss_of_the_same_pairs():
    module, params = _reward_model(num_layers=3)
    data = _pairs_with_a_lone_pair(np.random.default_rng(4))
    groups = reward.prompt_groups(data)
    trunk = reward.pair_trunk(module, params, data, 2, batch_size=4)
    for chosen_groups, pairs in (([0, 1, 2, 3], np.arange(10)), ([3, 1], np.array([9, 3, 4, 5]))):
        pair_batch = {k: jnp.asarray(data[k][pairs]) for k in reward.PAIR_KEYS}
        full = optim.with_frozen_leaves(lambda p, b: reward.rm_loss(module, p, b), 1)
        (want, want_metrics), want_grads = jax.value_and_grad(full, has_aux=True)(params,
                                                                                  pair_batch)
        for use_trunk in (False, True):
            rows = groups.training_data(data, trunk if use_trunk else None)
            batch = {k: jnp.asarray(v[chosen_groups]) for k, v in rows.items()}
            grouped = optim.with_frozen_leaves(
                lambda p, b: reward.grouped_rm_loss(module, p, b, 2 if use_trunk else 0), 1)
            (got, got_metrics), got_grads = jax.value_and_grad(grouped, has_aux=True)(params,
                                                                                     batch)
            np.testing.assert_allclose(got, want, rtol=1e-5)
            for key in ("accuracy", "margin", "chosen_mean", "rejected_mean"):
                np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-4,
                                           atol=1e-6)
            for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
                np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)


def test_run_rm_by_prompt_trains_the_same_params_with_and_without_trunk_or_accumulation(
        tmp_path):
    module, init = _reward_model(num_layers=3)
    init = jax.tree.map(np.asarray, init)
    data = _pairs_with_a_lone_pair(np.random.default_rng(5))
    task = types.SimpleNamespace(rm=data)
    out = {}
    for name, accum, trunk in (("full", 1, None), ("accum", 2, None),
                               ("trunk", 1, reward.pair_trunk(module, init, data, 2,
                                                              batch_size=4))):
        config = base_config()
        # 8 prompts a step (each of the 4 twice: two shuffled epochs), over the 8 devices.
        config.rm.update(dict(steps=3, batch_size=8, learning_rate=1e-2, warmup_ratio=0.0,
                              num_layers_unfrozen=1, group_by_prompt=True,
                              grad_accum_steps=accum))
        config.checkpoint_every = 1000
        workdir = str(tmp_path / name)
        writer = metrics.MetricsWriter(workdir, tensorboard=False)
        out[name] = reward.run_rm(config, task, module, init, mesh=sharding.make_mesh(
            config.mesh), writer=writer, workdir=workdir, trunk=trunk)
        writer.close()
    # The first step's two micro-batches (rows j, j + 2, ...) hold 12 and 8 pairs: equal
    # micro-batch weights would not give the mean over the step's pairs.
    from marl_jax.data import batches
    rows = batches.batch_indices(4, 8, base_config().seed + 1, 0)
    pairs = reward.prompt_groups(data).pair_mask.sum(axis=1)
    assert pairs[rows[0::2]].sum() != pairs[rows[1::2]].sum()
    for a, b, c in zip(jax.tree.leaves(out["full"]), jax.tree.leaves(out["accum"]),
                       jax.tree.leaves(out["trunk"])):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-5)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(c)).max())
                for a, c in zip(jax.tree.leaves(out["full"]), jax.tree.leaves(init)))
    assert moved > 1e-3


def test_the_pipelines_reward_model_and_statistics_do_not_depend_on_the_trunk(tmp_path,
                                                                            monkeypatch):
    """Pipeline.rm with every stage training its top layer of 2: trained on trunk states (the
    shipped path) and on whole sequences (the trunk turned off) the same model and statistics."""
    from marl_jax import pipeline as pipeline_lib
    from train_util import tiny_config

    overrides = {"model.config.num_layers": 2, "model.scan_layers": False,
                 "sft.num_layers_unfrozen": 1, "rm.num_layers_unfrozen": 1}
    built = []
    real = reward.pair_trunk
    monkeypatch.setattr(reward, "pair_trunk", lambda *a, **k: built.append(a[3]) or real(*a, **k))
    out = {}
    for name in ("trunk", "full"):
        if name == "full":
            monkeypatch.setattr(reward, "frozen_trunk_layers", lambda params, n: 0)
        pipe = pipeline_lib.Pipeline(tiny_config(**overrides), str(tmp_path / name))
        out[name] = pipe.rm()
        pipe.close()
    assert built == [1]  # the first run trained on the states after layer 1 of 2
    (trunk_params, trunk_stats), (full_params, full_stats) = out["trunk"], out["full"]
    for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(trunk_params)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([trunk_stats["mean"], trunk_stats["std"]],
                               [full_stats["mean"], full_stats["std"]], rtol=1e-4, atol=1e-5)


def test_several_evaluation_samples_per_prompt_average_the_gold_per_prompt():
    from marl_jax.train import ppo_types

    reward_model, rm_params = _reward_model()
    policy = models.CausalLM(reward_model.config)
    params = models.init_params(policy, jax.random.key(4))
    mods = ppo_types.Models(policy=policy, critic=reward_model, reward=reward_model,
                       actor_optimizer=None, critic_optimizer=None)
    static = ppo_types.PPOStatic(batch_size=4, response_length=5, eos_id=1, pad_id=0, top_k=0)
    frozen = ppo_types.Frozen(params, rm_params, jnp.float32(0.5), jnp.float32(2.0))
    prompts = jnp.asarray(np.random.default_rng(2).integers(2, 32, (3, 4)), jnp.int32)
    prompt_mask = jnp.asarray(np.array([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]), jnp.int32)
    documents = jnp.arange(3)[:, None] * 100
    # A gold that depends on the document and on the response: doc + tokens' sum.
    gold_fn = lambda docs, ids, mask: docs[:, 0] + (ids * mask).sum(axis=1).astype(jnp.float32)
    out = ppo_lib.evaluate(static, mods, params, frozen, prompts, prompt_mask, documents,
                           jax.random.key(0), gold_fn=gold_fn, samples_per_prompt=3)
    ids, mask = np.asarray(out["response_ids"]), np.asarray(out["response_mask"])
    assert ids.shape == (9, 5)
    # Row 3 e + j is sample j of prompt e: the samples of a prompt differ.
    assert len({tuple(r) for r in ids[:3]}) > 1
    per_row = np.repeat([0, 100, 200], 3) + (ids * mask).sum(axis=1)
    np.testing.assert_allclose(out["gold"], per_row.reshape(3, 3).mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(out["length"], mask.sum(axis=1).reshape(3, 3).mean(axis=1))
    # KL and RM score: the first sample of each prompt, scored one sequence at a time.
    assert out["kl"].shape == out["rm_score"].shape == (3,)
    np.testing.assert_allclose(out["kl"], 0.0, atol=1e-5)  # the policy is the reference
    for e in range(3):
        want = _one_sequence_score(reward_model, rm_params, np.asarray(prompts[e]),
                                   np.asarray(prompt_mask[e]), ids[3 * e], mask[3 * e])
        np.testing.assert_allclose(out["rm_score"][e], (want - 0.5) / 2.0, rtol=1e-4,
                                   atol=1e-5)


def test_the_host_gold_of_a_prompt_is_the_mean_over_its_samples_in_held_out_order():
    from marl_jax.experiment import host_gold_per_prompt

    # 1 run, 2 prompts x 3 samples, row 3 e + j = sample j of prompt e; token t decodes to "t".
    ids = np.array([[[10, 11], [12, 0], [13, 14], [20, 0], [21, 22], [23, 0]]])
    mask = (ids > 0).astype(np.int32)
    decode = lambda i, m: [" ".join(str(t) for t in row[k == 1]) for row, k in zip(i, m)]
    calls = []

    def text_gold(texts):
        calls.append(list(texts))
        return [float(sum(int(w) for w in t.split())) for t in texts]

    gold = host_gold_per_prompt(text_gold, decode, ids, mask, 3)
    # Each call holds sample j of every prompt, in held-out order.
    assert calls == [["10 11", "20"], ["12", "21 22"], ["13 14", "23"]]
    np.testing.assert_allclose(gold, [[(21 + 12 + 27) / 3, (20 + 43 + 23) / 3]])
