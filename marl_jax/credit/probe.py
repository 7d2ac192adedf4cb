"""How right is each advantage (`config.credit`): at chosen steps of a PPO run, every estimator's
advantages on one rollout of fixed held-out prompts, scored against Monte Carlo ground truth.

The probe (`CreditProbe`, which the pipeline hands `train.ppo.run_ppo`, `credit.hook`, called
at step 0 and every `credit.every` steps) samples `group_size` responses to each of the first
`credit.prompts` held-out prompts with the current actor and scores them as the run does
(`phases.score.score`: logprobs, KL, the critic's values, the reward model's score, the
per-token rewards r_t). On that batch it computes

- `token_gae`: GAE over tokens with the run's critic and lam;
- for every rule of `credit.rules` (on-device terminations, `macro.termination.segment`, and
  `parsing`, parsed on the host as the PPO step parses, `parsing_segments`) and
  value weighting of `credit.weightings`: `macro_gae/<rule>/<weighting>` (the run's critic,
  reward aggregation and lam), and its matched token control `control/<rule>`: token GAE with
  lam^(1/L), L the rule's mean macro length on this batch;
- `macro_mc/fixed`: macro returns from Monte Carlo values at the fixed n-gram starts
  (`credit.mc_rollouts` continuations of their own, drawn with other keys than the truth's);
- `grpo` and `rloo` over the groups of `group_size` samples;

and the ground truth (`marl_jax.credit.truth`): from every state (b, t), t in [0, L_b], of
every response, `credit.continuations` (K) continuations rewarded by the run's own per-token
reward (`credit.truth="reward"`), or by the task's gold on the last token alone, without KL terms
(`"gold"`: `gold_reward_fn`, the synthetic task's on device, the review task's on decoded text
on the host), give V(s_t), and the same reward gives the row's own r_t; a token's
A*_t = r_t + V(s_{t+1}) - V(s_t) and a macro's the sum of its rewards
plus V at its end minus V at its start. Each estimator's per-token advantage is scored against
A*_t of every response token (the weight token t's log-probability gradient should have),
and each macro estimator's advantage against its rule's macro A* (`estimator_scores`:
Pearson, Spearman, sign agreement, variance, bootstrap intervals over prompts), beside the
noise ceiling of the truth (two independent halves of the K).

Every draw of a probe (its responses, the rules' random cuts, the Monte Carlo macro values'
and the truth's continuations) comes from `probe_keys(probe_seed(credit.seed, config.seed),
step)`: a run's own seed enters, so runs of different seeds share no random number, and the
same run resumed draws the same.

Each probe writes a `credit` metrics row (`credit/<level>/<estimator>/<score>`) and its inputs
to `<workdir>/credit/step_<n>.npz` (the probe seed, the truth's name, prompts, responses, the
truth's per-token rewards (and the run's, `run_rewards`, where they differ) and critic values,
every state's V with its standard error, halves and continuation returns (`state_returns
[M, K]`), every estimator's advantages and every rule's segment ids), from which
`experiments/credit_report.py` pools runs into the study's table.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import estimators
from marl_jax import rollout as rollout_engine
from marl_jax.credit import truth as credit_truth
from marl_jax.credit.probe_scores import score_probe, token_spans
from marl_jax.macro import termination
from marl_jax.train import metrics
from marl_jax.train.phases import advantages as adv_phase
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import Experience, Frozen, Models, PPOState, PPOStatic, role_params

# Scores written to the metrics row per estimator and level (their intervals stay in the npz
# inputs, from which the report recomputes them over pooled runs).
ROW_SCORES = ("pearson", "spearman", "sign_agreement")
GROUP_ESTIMATORS = ("grpo", "rloo")
MC_RULE = "fixed"
TRUTHS = ("reward", "gold")


class ProbeKeys(NamedTuple):
    """The keys of one probe's draws: the sampled responses, the segmentation (rules that
    draw, e.g. randomized n-grams), the Monte Carlo macro values' continuations and the
    truth's continuations."""

    responses: jax.Array
    segments: jax.Array
    macro_mc: jax.Array
    truth: jax.Array


def probe_seed(credit_seed: int, run_seed: int) -> int:
    """The seed of a run's probe: `credit.seed` and the run's own `config.seed` together, so
    that runs of different seeds share no probe draw (responses, segmentation, Monte Carlo
    macro values, truth continuations and, on a multi-turn task, episode seeds)."""
    return int(np.random.SeedSequence([int(credit_seed), int(run_seed)]).generate_state(1)[0])


def probe_keys(seed: int, step: int) -> ProbeKeys:
    """The keys of the probe at `step` of the run whose probe seed is `seed` (`probe_seed`)."""
    return ProbeKeys(*jax.random.split(jax.random.fold_in(jax.random.key(seed), step), 4))


def probe_steps(every: int, total_steps: int) -> list[int]:
    """The steps a probe runs at: 0, every `every`, and the last."""
    if every <= 0:
        return []
    return sorted({0, total_steps, *range(0, total_steps + 1, every)})


def probe_documents(task, static: PPOStatic, prompts: int):
    """`[n, D]` the documents of the probe's first `prompts` held-out prompts where the run's
    reward reads them (`ppo.reward_source=gold`: the synthetic task's gold of each prompt's
    document), else None."""
    if static.reward_source != "gold":
        return None
    return jnp.asarray(np.asarray(task.eval["documents"])[:prompts])


def _sampled(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
             prompt_mask, documents, key, group_size: int):
    """`group_size` responses to each prompt (and its document `[B, D]`, or None) from the
    current actor, scored as the run scores them: Experience, prompts repeated `[B * k, P]`."""
    actor = role_params(static, "actor", frozen, state.actor_params)
    out = rollout_engine.generate(
        models.policy, actor, prompt_ids, prompt_mask, key=key,
        max_new_tokens=static.response_length, temperature=static.temperature,
        top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
        num_samples=group_size)
    ids, mask = (jnp.repeat(a, group_size, axis=0) for a in (prompt_ids, prompt_mask))
    docs = None if documents is None else jnp.repeat(documents, group_size, axis=0)
    exp, _ = score.score(static, models, state, frozen, ids, mask, out.tokens,
                         out.mask.astype(jnp.int32), docs, sampled_logprobs=out.logprobs,
                         sampled_entropy=out.entropy)
    return exp


def run_token_rewards(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                      prompt_ids, prompt_mask, response_ids, response_mask, documents=None):
    """The run's per-token rewards `[N, R]` of responses (and their prompts' documents
    `[N, D]`, where the run's reward reads them)."""
    exp, _ = score.score(static, models, state, frozen, prompt_ids, prompt_mask, response_ids,
                         response_mask.astype(jnp.int32), documents)
    return exp.rewards


def run_reward_fn(reward, state: PPOState, frozen: Frozen, documents, group_size: int):
    """The truth's reward_fn (called with `rows`, see `marl_jax.credit.truth`) for the run's
    own reward: `reward` (`run_token_rewards`, jitted) under `state`, each row scored with the
    document of its held-out prompt, rows // group_size, where `documents` (`probe_documents`) is
    not None."""
    def reward_fn(prompt_ids, prompt_mask, response_ids, response_mask, *, rows):
        docs = None if documents is None else documents[jnp.asarray(rows) // group_size]
        return reward(state, frozen, prompt_ids, prompt_mask, response_ids, response_mask, docs)
    return reward_fn


def last_token_rewards(scores, response_mask) -> np.ndarray:
    """float64 `[N, R]`: each response's score (`scores [N]`) on its last valid token, 0 on
    every other token (and on every token of an empty response)."""
    mask = np.asarray(response_mask)
    lengths = credit_truth.valid_lengths(mask)
    out = np.zeros(mask.shape, np.float64)
    rows = np.flatnonzero(lengths > 0)
    out[rows, lengths[rows] - 1] = np.asarray(scores, np.float64)[rows]
    return out


def gold_reward_fn(task, group_size: int):
    """The truth's reward_fn for `credit.truth="gold"` (called with `rows`, see
    `marl_jax.credit.truth`): the gold `[N]` of each response to held-out prompt
    rows // group_size, on its last token (`last_token_rewards`). The synthetic task's `gold_fn`
    runs on device with the prompt's document; the review task's `eval_gold` on the decoded
    text, on the host."""
    if task.gold_fn is not None:
        documents = np.asarray(task.eval["documents"])
        gold = jax.jit(task.gold_fn)

        def scores(prompts, response_ids, response_mask):
            return gold(jnp.asarray(documents[prompts]), jnp.asarray(response_ids),
                        jnp.asarray(response_mask, jnp.int32))
    elif task.eval_gold is not None:
        from marl_jax.data.real_tasks import decode_responses

        def scores(prompts, response_ids, response_mask):
            texts = decode_responses(task.tokenizer, response_ids,
                                     credit_truth.valid_lengths(response_mask)[:, None]
                                     > np.arange(np.shape(response_mask)[1]))
            return task.eval_gold(texts, rows=prompts)
    else:
        raise ValueError("config.credit.truth='gold': the task has no gold")

    def reward_fn(prompt_ids, prompt_mask, response_ids, response_mask, *, rows):
        return last_token_rewards(np.asarray(scores(np.asarray(rows) // group_size, response_ids,
                                                    response_mask)), response_mask)
    return reward_fn


def parsing_termination(ppo, tokenizer):
    """The PPO step's parser (`phased_step.PhasedStep`: `config.ppo`'s parsing knobs, its n-gram
    fallback and isolate_last) on the task's tokenizer."""
    from marl_jax.macro.parsing import ParsingTermination

    return ParsingTermination(tokenizer, model=ppo.parsing_model, cutoff=ppo.parsing_cutoff,
                              fallback_n=ppo.ngram, isolate_last=ppo.isolate_last)


def parsing_segments(parser, exp: Experience) -> np.ndarray:
    """int32 `[B, R]`: the parsing rule's segment ids of the responses, from their tokens on the
    host, as the PPO step computes them (`parser`: `parsing_termination`)."""
    segment_ids, _ = parser(np.asarray(exp.response_ids), np.asarray(exp.response_mask, np.int32))
    return segment_ids


def rule_segments(static: PPOStatic, exp: Experience, rules, key, ngram: int, parser=None,
              turn_ids=None) -> dict:
    """Segment ids `[B, R]` of every rule on the batch; `parsing` by `parser` on the host; with
    `turn_ids` `[B, R]` (a trajectory's turns) every rule cuts within turns and `turn` is one
    macro per turn, as the run cuts them."""
    return {rule: parsing_segments(parser, exp) if rule == "parsing" else termination.segment(
        rule, exp.actions, key=key, ref_logprobs=exp.ref_base_logprobs,
        entropies=exp.entropies, logprobs=exp.old_logprobs, n=ngram,
        lengths=static.randomized_lengths, repeats=static.randomized_repeats,
        entropy_quantile=static.entropy_quantile,
        low_probability_quantile=static.low_probability_quantile,
        low_probability_threshold=static.low_probability_threshold or None,
        isolate_last=static.isolate_last, turn_ids=turn_ids, token_ids=exp.response_ids,
        step_table=static.step_table) for rule in rules}


def gae_advantages(exp: Experience, segment_ids, *, gamma, lam, weighting="equal",
                   aggregation="weighted"):
    """GAE advantages `[B, R]` of the run's critic values and rewards over `segment_ids`
    (one segment per token: token GAE)."""
    adv, _ = estimators.ESTIMATORS["gae"].advantages(
        exp.values, exp.rewards, exp.actions, segment_ids, gamma=gamma, lam=lam,
        value_weighting=weighting, reward_aggregation=aggregation)
    return adv


# The Monte Carlo macro values' continuations as one program (eagerly, every op of every
# layer would be dispatched on its own).
_monte_carlo_returns = jax.jit(adv_phase.monte_carlo_returns, static_argnums=(0, 1))


def estimator_advantages(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                         exp: Experience, segments: dict, *, gamma: float, lam: float,
                         weightings, aggregation: str, group_size: int, mc_rollouts: int,
                         key) -> dict:
    """name -> advantages `[B, R]` of every estimator the probe scores (see the module)."""
    mask = exp.actions
    tokens = termination.fixed_ngram(mask, 1, isolate_last=False)
    out = {"token_gae": gae_advantages(exp, tokens, gamma=gamma, lam=lam)}
    for rule, seg in segments.items():
        for weighting in weightings:
            out[f"macro_gae/{rule}/{weighting}"] = gae_advantages(exp, seg, gamma=gamma, lam=lam,
                                                        weighting=weighting,
                                                        aggregation=aggregation)
        length = float(termination.mean_macro_length(seg, mask))
        out[f"control/{rule}"] = gae_advantages(exp, tokens, gamma=gamma, lam=lam ** (1.0 / length))
    inputs = adv_phase.advantage_inputs(static, exp, state.kl_coef, group_size)
    for name in GROUP_ESTIMATORS:
        out[name] = estimators.ESTIMATORS[name].advantages(inputs)
    if MC_RULE in segments:
        seg = segments[MC_RULE]
        starts = (np.asarray(seg != jnp.pad(seg, ((0, 0), (1, 0)), constant_values=-1)[:, :-1])
                  & (np.asarray(mask) != 0))
        # Every macro start of every row is a branch point (as `mc_branch_points=0`).
        order = np.argsort(~starts, axis=1, kind="stable")
        count = starts.sum(axis=1)
        width = int(max(count.max(), 1))
        points = order[:, :width].astype(np.int32)
        valid = np.arange(width)[None, :] < count[:, None]
        points = np.where(valid, points, 0)  # an unused slot continues from the prompt
        mc_static = dataclasses.replace(static, mc_rollouts=mc_rollouts)
        actor = role_params(static, "actor", frozen, state.actor_params)
        returns, _ = _monte_carlo_returns(
            mc_static, models, actor, frozen, exp, jnp.asarray(points), jnp.asarray(valid), key,
            state.kl_coef)
        out[f"macro_mc/{MC_RULE}"] = estimators.ESTIMATORS["macro_mc"].advantages(
            inputs._replace(branches=(jnp.asarray(points), jnp.asarray(valid),
                                      returns.mean(axis=-1))))
    return {name: np.asarray(a, np.float64) for name, a in out.items()}


def truth_progress(step: int, continuations: int):
    """The truth's progress callback: one line per chunk of states valued, with its rate."""
    start = time.monotonic()

    def progress(done: int, total: int) -> None:
        elapsed = time.monotonic() - start
        metrics.status_line(f"[credit step {step}] states {done}/{total} "
                            f"({done * continuations / max(elapsed, 1e-9):.1f} continuations/s)  "
                            f"eta {(total - done) * elapsed / max(done, 1):.0f} s")
    return progress


class CreditProbe:
    """The probe of one PPO run (see the module); `probe(state, frozen, hparams, step)` ->
    a metrics row, its inputs saved under `<workdir>/credit/`."""

    def __init__(self, config, task, static: PPOStatic, models: Models, workdir: str):
        self.c = config.credit
        self.static, self.models = static, models
        self.steps = set(probe_steps(int(self.c.every), int(config.ppo.steps)))
        n = int(self.c.prompts)
        if len(task.eval["ids"]) < n:
            raise ValueError(f"config.credit.prompts={n}: the task has "
                             f"{len(task.eval['ids'])} held-out prompts")
        self.prompt_ids = jnp.asarray(np.asarray(task.eval["ids"])[:n])
        self.prompt_mask = jnp.asarray(np.asarray(task.eval["mask"])[:n])
        self.documents = probe_documents(task, static, n)
        self.seed = probe_seed(int(self.c.seed), int(config.seed))
        self.ngram = int(config.ppo.ngram)
        self.aggregation = config.ppo.reward_aggregation
        self.directory = os.path.join(workdir, "credit")
        self._sample = jax.jit(functools.partial(_sampled, static, models),
                               static_argnames="group_size")
        self._reward = jax.jit(functools.partial(run_token_rewards, static, models))
        self.parser = (parsing_termination(config.ppo, task.tokenizer)
                       if "parsing" in tuple(self.c.rules) else None)
        self.truth = self.c.get("truth", "reward")
        if self.truth not in TRUTHS:
            raise ValueError(f"config.credit.truth={self.truth!r}: must be one of {TRUTHS}")
        self._gold = (gold_reward_fn(task, int(self.c.group_size)) if self.truth == "gold"
                      else None)

    def due(self, step: int) -> bool:
        return step in self.steps

    def probe_inputs(self, state: PPOState, frozen: Frozen, hparams, step: int) -> dict:
        """The arrays one probe scores (numpy): prompts, responses, rewards, states' values,
        segments and every estimator's advantages."""
        c, static = self.c, self.static
        keys = probe_keys(self.seed, step)
        exp = self._sample(state, frozen, self.prompt_ids, self.prompt_mask, self.documents,
                           keys.responses, group_size=int(c.group_size))
        segments = rule_segments(static, exp, tuple(c.rules), keys.segments, self.ngram,
                                 self.parser)
        gamma, lam = float(hparams.gamma), float(hparams.lam)
        advantages = estimator_advantages(
            static, self.models, state, frozen, exp, segments, gamma=gamma, lam=lam,
            weightings=tuple(c.weightings), aggregation=self.aggregation,
            group_size=int(c.group_size), mc_rollouts=int(c.mc_rollouts), key=keys.macro_mc)
        rows, starts, ends = token_spans(exp.actions)
        actor = role_params(static, "actor", frozen, state.actor_params)
        reward_fn = self._gold or run_reward_fn(self._reward, state, frozen, self.documents,
                                                int(c.group_size))
        truth = credit_truth.advantage_truth(
            self.models.policy, actor, exp.prompt_ids, exp.prompt_mask, exp.response_ids,
            exp.actions, rows, starts, ends,
            reward_fn=reward_fn, key=keys.truth,
            num_continuations=int(c.continuations), temperature=static.temperature,
            top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
            gamma=gamma, chunk_states=int(c.chunk_states), reward_rows=True,
            progress=truth_progress(step, int(c.continuations)))
        states = truth.states
        rewards = (exp.rewards if self._gold is None else
                   reward_fn(exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.actions,
                             rows=np.arange(exp.response_ids.shape[0])))
        return {
            "step": np.int64(step), "probe_seed": np.int64(self.seed),
            "truth": np.str_(self.truth),
            "group_size": np.int64(c.group_size),
            "gamma": np.float64(gamma),
            "prompt_ids": np.asarray(exp.prompt_ids), "prompt_mask": np.asarray(exp.prompt_mask),
            "response_ids": np.asarray(exp.response_ids),
            "response_mask": np.asarray(exp.actions),
            "rewards": np.asarray(rewards, np.float64),
            # The run's own rewards, which the estimators read, where the truth's differ.
            **({} if self._gold is None else
               {"run_rewards": np.asarray(exp.rewards, np.float64)}),
            "values": np.asarray(exp.values, np.float64), "lam": np.float64(lam),
            "state_rows": states.rows, "state_positions": states.positions,
            "state_mean": states.mean, "state_se": states.se, "state_halves": states.halves,
            "state_returns": states.returns,
            **{f"segments/{rule}": np.asarray(seg) for rule, seg in segments.items()},
            **{f"advantages/{name}": a for name, a in advantages.items()},
        }

    def __call__(self, state: PPOState, frozen: Frozen, hparams, step: int) -> dict:
        inputs = self.probe_inputs(state, frozen, hparams, step)
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"step_{step}.npz")
            np.savez(path + ".tmp.npz", **inputs)
            os.replace(path + ".tmp.npz", path)
        prompts = np.arange(inputs["response_ids"].shape[0]) // int(self.c.group_size)
        scores, ceilings = score_probe(inputs, prompts, resamples=200)
        row = {"stage": "credit", "step": step,
               "credit/states": int(inputs["state_rows"].size)}
        for level, by_name in scores.items():
            row[f"credit/{level}/noise_ceiling"] = ceilings[level]["ceiling"]["value"]
            for name, result in by_name.items():
                for s in ROW_SCORES:
                    row[f"credit/{level}/{name}/{s}"] = result[s]["value"]
        return row
