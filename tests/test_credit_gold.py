"""The advantage-quality probe against the task's gold (`config.credit.truth="gold"`,
marl_jax/credit/probe.py), on a run rewarded by the gold (`ppo.reward_source=gold`): the
truth's rewards and the run's are the synthetic task's gold on the last token, the documents
read back from the prompts' tokens; every state's value is the mean discounted
gold of its continuations, redrawn with the truth's keys and scored token by token here; the
review task's host-side gold scores decoded text; a task without a gold is one line at config
time, exit status 2."""
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import marl_jax.models as M
from marl_jax import stages
from marl_jax.data import synthetic as syn
from marl_jax.data.tasks import synthetic_task_from_config
from marl_jax.credit import probe as credit
from marl_jax.credit import truth as ct
from marl_jax.train.metrics import read_metrics

from train_util import ROOT, tiny_config

CREDIT = {"credit.every": 1, "credit.prompts": 3, "credit.group_size": 2,
          "credit.continuations": 4, "credit.chunk_states": 64,
          "credit.rules": ("randomized",), "credit.weightings": ("equal",),
          "credit.mc_rollouts": 2, "credit.truth": "gold"}
TASK = synthetic_task_from_config(tiny_config().task)


def documents_of_prompts(prompt_ids, prompt_mask) -> np.ndarray:
    """`[B, doc_size]` entity indices read from the prompts' tokens ("doc: e03 e01 ... summary:")."""
    names = {i: w for w, i in TASK.ids.items()}
    return np.array([[int(names[t][1:]) for t, m in zip(ids, mask)
                      if m and names[t].startswith("e") and names[t][1:].isdigit()]
                     for ids, mask in zip(prompt_ids, prompt_mask)])


def gold_on_last_token(documents, ids, mask) -> np.ndarray:
    """`[N, R]`: the task's gold of each response on its last valid token, by a loop."""
    gold = syn.gold_score_tokens(TASK, documents, ids, mask)
    out = np.zeros(ids.shape)
    for b in range(ids.shape[0]):
        n = int(np.cumprod(mask[b] != 0).sum())
        if n:
            out[b, n - 1] = gold[b]
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """The probe of a run's first step against the gold, its policy and reward model as
    initialised (no training steps), the run rewarded by the gold too
    (`ppo.reward_source=gold`: the probe scores its responses with their prompts' documents):
    (workdir, rows by step)."""
    workdir = tmp_path_factory.mktemp("credit_gold") / "run"
    stages.run(tiny_config(**{"sft.steps": 0, "rm.steps": 0, "ppo.steps": 0,
                              "ppo.eval_every": 0, "ppo.reward_source": "gold", **CREDIT}),
               str(workdir))
    rows = {r["step"]: r for r in read_metrics(str(workdir)) if r["stage"] == "credit"}
    return workdir, rows


def test_the_truth_is_rewarded_by_the_gold_on_the_last_token(probed):
    workdir, rows = probed
    assert sorted(rows) == [0]
    for step, row in rows.items():
        x = dict(np.load(workdir / "credit" / f"step_{step}.npz"))
        assert str(x["truth"]) == "gold"
        mask = x["response_mask"]
        documents = documents_of_prompts(x["prompt_ids"], x["prompt_mask"])
        want = gold_on_last_token(documents, x["response_ids"], mask)
        np.testing.assert_allclose(x["rewards"], want, atol=1e-6)
        # The estimators read the run's rewards, saved beside: the gold of each prompt's
        # document too (clipped at 2.5, which a gold in [-1, 1] never reaches), with KL terms
        # that are 0 while the actor is the reference.
        np.testing.assert_allclose(x["run_rewards"], want, atol=1e-5)
        assert np.count_nonzero(want) >= mask.shape[0] // 2
        lengths = np.cumprod(mask != 0, axis=1).sum(axis=1)
        states = {(int(b), int(t)): i for i, (b, t) in enumerate(zip(x["state_rows"],
                                                                     x["state_positions"]))}
        v, gamma = x["state_mean"], float(x["gamma"])
        terminal = [states[(b, int(n))] for b, n in enumerate(lengths) if n]
        assert np.all(v[terminal] == 0) and np.all(x["state_se"][terminal] == 0)
        # A gold in [-1, 1], discounted: every value lies in [-1, 1].
        assert np.all(np.abs(v) <= 1 + 1e-6)
        truth = np.concatenate([[want[b, t] + gamma * v[states[(b, t + 1)]] - v[states[(b, t)]]
                                 for t in range(lengths[b])] for b in range(mask.shape[0])])
        estimate = np.concatenate([x["advantages/token_gae"][b, :n]
                                   for b, n in enumerate(lengths)])
        assert row["credit/token/token_gae/pearson"] == pytest.approx(
            np.corrcoef(estimate, truth)[0, 1], abs=1e-9)


def test_state_values_are_the_mean_discounted_gold_of_their_continuations():
    """On a random model over the task's vocabulary: the truth's continuations of the first,
    the before-last and the terminal state of each response, redrawn with the same keys, scored
    by the gold here."""
    config = M.ModelConfig.for_family("llama", vocab_size=len(TASK.vocab), hidden_size=16,
                                      intermediate_size=32, num_layers=1, num_heads=2,
                                      num_kv_heads=1, head_dim=8, max_position_embeddings=32)
    model = M.CausalLM(config)
    params = M.init_params(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    group, width, k, gamma = 2, 10, 6, 0.9
    documents = syn.sample_documents(TASK, rng, 2)
    prompt = [[TASK.ids[w] for w in syn.prompt_text(TASK, d).split()] for d in documents]
    prompt_ids = jnp.asarray(np.repeat(prompt, group, axis=0), jnp.int32)
    prompt_mask = jnp.ones_like(prompt_ids)
    response = np.zeros((4, width), np.int32)
    mask = np.zeros((4, width), np.int32)
    for b, n in enumerate((3, 5, 1, 7)):
        # Sampled responses end with EOS (or at the budget): (b, L_b) is terminal.
        response[b, :n - 1] = rng.integers(TASK.entity_offset, len(TASK.vocab), n - 1)
        response[b, n - 1] = TASK.ids[syn.EOS]
        mask[b, :n] = 1
    lengths = mask.sum(axis=1)
    rows = np.repeat(np.arange(4), 3)
    positions = np.stack([np.zeros(4, int), lengths - 1, lengths], axis=1).reshape(-1)
    task = types.SimpleNamespace(gold_fn=lambda *a: syn.gold_score_jax(TASK, *a),
                                 eval={"documents": documents}, eval_gold=None)
    sampling = {"temperature": 1.0, "eos_id": TASK.ids[syn.EOS], "pad_id": TASK.ids[syn.PAD]}
    key = jax.random.key(3)
    values = ct.state_values(model, params, prompt_ids, prompt_mask, jnp.asarray(response),
                             jnp.asarray(mask), rows, positions,
                             reward_fn=credit.gold_reward_fn(task, group), key=key,
                             num_continuations=k, gamma=gamma, chunk_states=5, reward_rows=True,
                             **sampling)
    out = ct.continue_states(model, params, prompt_ids, prompt_mask, jnp.asarray(response),
                             jnp.asarray(mask), rows, positions,
                             ct.continuation_keys(key, rows.size, k), **sampling)
    tokens, continued = np.asarray(out.tokens), np.asarray(out.mask)
    gold = syn.gold_score_tokens(TASK, documents[np.repeat(rows, k) // group], tokens, continued)
    ends = np.cumprod(continued != 0, axis=1).sum(axis=1)
    returns = (gold * gamma ** (ends - 1 - np.repeat(positions, k))).reshape(-1, k)
    returns[positions == lengths[rows]] = 0.0  # a terminal state earns nothing more
    np.testing.assert_allclose(values.returns, returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values.mean, returns.mean(axis=1), rtol=1e-5, atol=1e-6)
    assert np.all(values.mean[positions == lengths[rows]] == 0)


def test_a_host_gold_scores_the_decoded_text_of_each_row(tmp_path):
    """The review task's route: decoded text, the row's held-out prompt, the last token."""
    tokenizer = syn.build_tokenizer(TASK, str(tmp_path / "tokenizer"))
    seen = []

    def eval_gold(texts, rows):
        seen.append((list(texts), list(rows)))
        return np.array([len(t.split()) + 10.0 * r for t, r in zip(texts, rows)])

    task = types.SimpleNamespace(gold_fn=None, eval_gold=eval_gold, tokenizer=tokenizer)
    ids = np.array([[TASK.ids["e01"], TASK.ids["w02"], TASK.ids[syn.EOS], 0],
                    [TASK.ids["e03"], 0, 0, 0], [0, 0, 0, 0]], np.int32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.int32)
    rewards = credit.gold_reward_fn(task, 2)(None, None, ids, mask, rows=np.array([1, 2, 5]))
    assert seen == [(["e01 w02", "e03", ""], [0, 1, 2])]
    np.testing.assert_allclose(rewards, [[0, 0, 2.0, 0], [11.0, 0, 0, 0], [0, 0, 0, 0]])


def test_the_run_reward_scores_each_row_with_its_prompts_document():
    """A gold-rewarded run's reward as the truth's reward_fn: continued rows (probe rows 0..5,
    two samples a prompt) read the documents of their prompts, rows // 2."""
    documents = jnp.arange(3)[:, None] * 10 + jnp.arange(2)
    seen = []

    def reward(state, frozen, prompt_ids, prompt_mask, ids, mask, docs):
        seen.append(docs)
        return jnp.zeros(ids.shape)

    reward_fn = credit.run_reward_fn(reward, None, None, documents, 2)
    reward_fn(None, None, jnp.zeros((4, 3)), jnp.ones((4, 3)), rows=np.array([5, 0, 3, 2]))
    np.testing.assert_array_equal(np.asarray(seen[0]), [[20, 21], [0, 1], [10, 11], [10, 11]])
    credit.run_reward_fn(reward, None, None, None, 2)(None, None, jnp.zeros((1, 3)),
                                                      jnp.ones((1, 3)), rows=np.array([1]))
    assert seen[1] is None  # a run rewarded by its reward model reads no document


def test_a_task_without_a_gold_is_one_line_and_status_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"),
         f"--config={ROOT / 'configs' / 'tldr_smollm2.py'}", f"--workdir={tmp_path / 'run'}",
         "--config.credit.every=1", "--config.credit.truth=gold"],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: config.credit.truth='gold': gold needs a task with a gold (synthetic, reviews); "
        "task 'tldr' has none")
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
