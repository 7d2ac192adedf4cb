"""The pure functions of one PPO / MA-PPO step.

    rollout      generate responses, then one scoring pass: old and reference logprobs, critic
                 values, reward-model score; reward assembly (per-token KL + clipped score)
    segment      termination -> segment ids [B, R] (fixed | randomized | perplexity on device;
                 parsing arrives from the host)
    update       macro GAE, then `ppo_epochs` x `num_minibatches` actor and critic updates

Everything here is a pure function of pytrees and is jitted by the caller: `train/ppo.py` for one
sharded run, `experiment.py` vmapped over arms and seeds. Hyper-parameters that arms of an
experiment vary (kl_coef, lam, gamma, ngram, termination, weighting, aggregation) are traced
values in `RunHparams`, so a single compiled program serves every arm.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from marl_jax import estimators, losses
from marl_jax import rollout as rollout_engine
from marl_jax.macro import advantage, termination
from marl_jax.models import compute_weights, last_token_score, lora
from marl_jax.models.heads import (backbone_hidden, continuation_scores, scalar_outputs,
                                   trunk_states)
from marl_jax.train.optim import accumulate_gradients, applied_updates, apply_if_finite


@dataclasses.dataclass(frozen=True)
class PPOStatic:
    """Everything about a PPO step that is fixed at compile time (hashable)."""

    batch_size: int
    response_length: int
    eos_id: Any
    pad_id: int
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    # (termination, value_weighting, reward_aggregation) triples the traced `RunHparams.variant`
    # index selects from.
    variants: tuple = (("fixed", "equal", "weighted"),)
    randomized_lengths: tuple = (2, 3, 5, 10)
    randomized_repeats: int = 3
    isolate_last: bool = True
    ppo_epochs: int = 1
    num_minibatches: int = 1
    grad_accum_steps: int = 1  # micro-batches per optimizer update (per minibatch)
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.5
    kl_estimator: str = "k1"
    reward_clip: float = 2.5
    normalize_reward: bool = True
    missing_eos_penalty: float = 0.0
    whiten_advantages: bool = False
    loss_aggregation: str = "token_mean"  # `losses.aggregate_tokens` (resolved, never "auto")
    # The compute dtype and matmul precision of the models (the sampler's and the trainer's
    # logprobs agree in float32 at highest precision).
    compute_dtype: str = "float32"
    matmul_precision: str = "highest"
    # PPO's old logprobs: "trainer" (the actor's scoring pass), "sampler" (the sampler's), or
    # "auto" (see `reuses_sampler_logprobs`).
    old_logprobs: str = "auto"
    # Truncated importance weights on each token's policy-gradient term
    # (`losses.rollout_correction_weights`): "none", "token", "sequence" or "macro".
    rollout_correction: str = "none"
    rollout_is_cap: float = 2.0
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    # "rm": the frozen reward model scores responses (the paper); "gold": the task's gold
    # function does (synthetic task only), an oracle reward model that isolates credit assignment
    # from reward-model error; "host": scores computed on the host between generation and
    # scoring (e.g. the fraction of APPS unit tests passed).
    reward_source: str = "rm"
    # How advantages are estimated (`marl_jax.estimators`): "gae" (macro GAE with a critic) or
    # one of the critic-free estimators, which build and train no critic.
    estimator: str = "gae"
    group_size: int = 1  # samples per prompt (rows of a group adjacent); batch_size counts rows
    mc_rollouts: int = 4  # macro_mc: continuations per branch point
    mc_branch_points: int = 4  # macro_mc: branch points per response (0: every macro start)
    entropy_quantile: float = 0.2  # entropy termination: the top fraction of tokens start macros
    num_layers_unfrozen: int = -1  # actor and critic train their top n layers only (-1: all)
    # > 0: the actor, reference, critic and reward model have the same embeddings and first k
    # layers (all frozen), which the scoring pass and the update run once for all of them.
    shared_trunk_layers: int = 0
    # > 0: rollouts decode over this many slots (continuous batching, same samples; the KV cache
    # holds that many rows instead of the batch's); 0: one static batch.
    decode_slots: int = 0
    # LoRA: actor, critic and reward-model params are adapters (and heads) on the one frozen
    # base, `Frozen.ref_params`. The reference is the SFT policy: the base with the adapters off
    # when SFT merged its adapter into the base, else (`reference_adapters`) the base with the
    # SFT adapter, `Frozen.ref_adapters`, attached.
    lora: bool = False
    reference_adapters: bool = False
    # Prompts are sampled and scored in this many sequential chunks (`in_row_chunks`): the KV
    # cache and the scoring pass's activations hold one chunk's rows.
    rollout_chunks: int = 1

    @property
    def uses_critic(self) -> bool:
        return estimators.ESTIMATORS[self.estimator].needs_critic

    @property
    def kl_in_loss(self) -> bool:
        """The KL to the reference is a loss term (GRPO, Dr. GRPO), not in the reward."""
        return estimators.ESTIMATORS[self.estimator].kl_in_loss

    @property
    def reuses_sampler_logprobs(self) -> bool:
        """PPO's old logprobs are the sampler's (no scoring pass of the actor). "auto" reuses them
        where they are the trainer's numbers (`sampler_logprobs_are_exact`) and no correction
        needs the trainer's."""
        if self.old_logprobs == "auto":
            return sampler_logprobs_are_exact(self) and self.rollout_correction == "none"
        return self.old_logprobs == "sampler"

    @property
    def prompts_per_step(self) -> int:
        """Prompts sampled per step: `batch_size` rows are `group_size` samples of each."""
        return self.batch_size // self.group_size


@flax.struct.dataclass
class RunHparams:
    """Per-run hyper-parameters, traced (a leading axis when vmapped over arms)."""

    lam: jax.Array
    gamma: jax.Array
    ngram: jax.Array  # int32
    variant: jax.Array  # int32 index into PPOStatic.variants


@flax.struct.dataclass
class PPOState:
    step: jax.Array
    actor_params: Any
    actor_opt_state: Any
    critic_params: Any
    critic_opt_state: Any
    key: jax.Array  # raw uint32 base key data; step keys are fold_in(key, step)
    kl_coef: jax.Array
    skipped_updates: jax.Array
    # Cumulative sampling budget of the run: response tokens generated (every sample, branches
    # included) and prompt (+ prefix) tokens prefilled. float32 scalars.
    generated_tokens: jax.Array = None
    prefill_tokens: jax.Array = None


@flax.struct.dataclass
class Frozen:
    """What a PPO run reads but never updates. With LoRA `ref_params` is the base every role's
    adapters attach to (`role_params`), `rm_params` the reward model's adapters and head, and
    `ref_adapters` the SFT adapter the reference applies when it was not merged into the base
    (`PPOStatic.reference_adapters`; None otherwise)."""

    ref_params: Any
    rm_params: Any
    reward_mean: jax.Array
    reward_std: jax.Array
    ref_adapters: Any = None


@flax.struct.dataclass
class Experience:
    prompt_ids: jax.Array  # [B, P]
    prompt_mask: jax.Array  # [B, P]
    response_ids: jax.Array  # [B, R]
    response_mask: jax.Array  # [B, R]
    old_logprobs: jax.Array  # [B, R]
    ref_logprobs: jax.Array  # [B, R] at the sampling temperature (the KL penalty)
    ref_base_logprobs: jax.Array  # [B, R] at temperature 1 (perplexity termination)
    values: jax.Array  # [B, R]
    scores: jax.Array  # [B] normalised RM score (before clipping)
    rewards: jax.Array  # [B, R]
    ended_with_eos: jax.Array  # [B]
    entropies: jax.Array = None  # [B, R] sampling entropy of each token (entropy termination)
    documents: Any = None  # [B, D] the synthetic task's documents (gold scores of branches)
    trunk: Any = None  # [B, P + R, D] the shared trunk's output (`shared_trunk`), or None
    # [B, R] the sampler's logprobs of the tokens, where a rollout correction weighs them.
    sampler_logprobs: Any = None


@dataclasses.dataclass(frozen=True)
class Models:
    policy: Any  # CausalLM
    critic: Any  # ScalarHeadModel (also the reward model's architecture)
    reward: Any  # ScalarHeadModel
    actor_optimizer: Any
    critic_optimizer: Any
    gold_fn: Any = None  # gold_fn(documents [B, D], ids [B, R], mask [B, R]) -> [B]
    # Learning rate of optimizer update i (for the `lr` metrics); counts updates, not steps.
    actor_schedule: Any = None
    critic_schedule: Any = None


# The models a PPO step applies: the actor and the critic (params in the state), the reward
# model and the reference (params in `Frozen`).
ROLES = ("actor", "critic", "reward", "reference")


def role_params(static: PPOStatic, role: str, frozen: Frozen, params=None):
    """The params the model of `role` (`role_model`) applies: the actor's and the critic's
    `params` (the state's), the reward model's and the reference's from `frozen`. With LoRA a
    role's adapters (and head) are attached to the one frozen base (a tree of the same arrays, no
    copy); the reference is the base, with the SFT adapter attached when
    `static.reference_adapters`. Every call site of a role takes its params from here."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "reference":
        if static.lora and static.reference_adapters:
            return lora.attach(frozen.ref_params, frozen.ref_adapters)
        return frozen.ref_params
    if role == "reward":
        params = frozen.rm_params
    return lora.attach(frozen.ref_params, params) if static.lora else params


def role_model(static: PPOStatic, models: Models, role: str):
    """The module that applies `role_params(static, role, ...)`: the policy for the actor and
    the reference, the critic, the reward model. A LoRA reference without adapters is the policy
    with its adapters switched off (`lora.adapters_off`)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "critic":
        return models.critic
    if role == "reward":
        return models.reward
    if role == "reference" and static.lora and not static.reference_adapters:
        return lora.adapters_off(models.policy)
    return models.policy


def in_row_chunks(n: int, fn, *rows):
    """`fn(*rows)` computed over `n` sequential chunks of the rows (arrays `[B, ...]` or None),
    row r in chunk r % n so each chunk spreads over the batch-sharded devices, the outputs
    (each with a leading row axis) joined back in row order. For functions whose rows are
    independent of each other, so only memory changes: one chunk's activations at a time."""
    if n == 1:
        return fn(*rows)
    split = lambda x: x.reshape((x.shape[0] // n, n) + x.shape[1:]).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: fn(*xs), jax.tree.map(split, rows))
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((-1,) + x.shape[2:]), out)


# ---- rollout -------------------------------------------------------------------------------------
def _concat(prompt_ids, prompt_mask, response_ids, response_mask):
    return (jnp.concatenate([prompt_ids, response_ids], axis=1),
            jnp.concatenate([prompt_mask, response_mask], axis=1))


def token_logprobs(policy, params, prompt_ids, prompt_mask, response_ids, response_mask,
                   temperature, trunk=None, rngs=None):
    """(logprobs `[B, R]`, entropy `[B, R]`): the logprob of each response token and the entropy
    of the temperature-scaled next-token distribution it was sampled from, 0 on padding,
    differentiable with respect to `params`. The one scoring path for old, reference and new
    logprobs. `trunk`: the shared trunk's output (`shared_trunk`), or None; `rngs`: the
    training forward's (`{"dropout": key}`), or None."""
    out = continuation_scores(policy, params, prompt_ids, prompt_mask, response_ids,
                              response_mask, temperature, trunk, rngs)
    return out.logprobs, out.entropy


def _scalar_per_token(module, params, ids, mask, trunk, rngs=None):
    if trunk is None:
        return module.apply({"params": params}, ids, mask, rngs=rngs)
    return scalar_outputs(module.config, params,
                          backbone_hidden(module.config, params, ids, mask, trunk, rngs))


def critic_outputs(critic, params, prompt_ids, prompt_mask, response_ids, response_mask,
                   trunk=None, rngs=None):
    """(values `[B, R]`, final `[B]`): the value of the state in which each response token is
    chosen (zero on padding), and the critic's output at the last valid token of prompt +
    response, where the reward model reads its score."""
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    per_token = _scalar_per_token(critic, params, ids, mask, trunk, rngs)
    p = prompt_ids.shape[1]
    return per_token[:, p - 1:-1] * response_mask, last_token_score(per_token, mask)


def response_values(critic, params, prompt_ids, prompt_mask, response_ids, response_mask,
                    trunk=None, rngs=None):
    """Critic values `[B, R]`: the value of the state in which each response token is chosen."""
    return critic_outputs(critic, params, prompt_ids, prompt_mask, response_ids,
                          response_mask, trunk, rngs)[0]


def sequence_scores(reward_model, params, prompt_ids, prompt_mask, response_ids, response_mask,
                    trunk=None):
    """Reward-model score `[B]` read at the last valid token of prompt + response."""
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    return last_token_score(_scalar_per_token(reward_model, params, ids, mask, trunk), mask)


def shared_trunk(static: PPOStatic, models: Models, params, prompt_ids, prompt_mask,
                 response_ids, response_mask):
    """(hidden states after the first `static.shared_trunk_layers` layers `[B, P + R, D]`, that
    count) of prompt + response, computed once for the actor, reference, critic and reward
    model, which share those layers and the embeddings (`ppo.shared_trunk_layers` checks it);
    None when they do not. Constant: no gradient flows into it."""
    k = static.shared_trunk_layers
    if not k:
        return None
    ids, mask = _concat(prompt_ids, prompt_mask, response_ids, response_mask)
    states = trunk_states(models.policy.config, params, ids, mask, k)
    return jax.lax.stop_gradient(states), k


def generate_responses(static: PPOStatic, models: Models, state: PPOState, prompt_ids,
                       prompt_mask, key, frozen: Frozen = None):
    """Samples `group_size` responses to each of `prompt_ids [B / group_size, P]` from the
    current actor (each prompt prefilled once): `SampleOutput` with tokens, logprobs, mask and
    entropy `[B, R]`, the samples of a prompt in adjacent rows."""
    groups = {} if static.group_size == 1 else {"num_samples": static.group_size}
    actor = role_params(static, "actor", frozen, state.actor_params)
    k, n = static.group_size, static.rollout_chunks

    def sample(ids, mask, chunk_key):
        out = rollout_engine.generate(
            models.policy, actor, ids, mask, key=chunk_key,
            max_new_tokens=static.response_length, temperature=static.temperature,
            top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id,
            decode_slots=static.decode_slots, **groups)
        # [prompts, k, ...]: a prompt's samples stay adjacent when the chunks are joined.
        return jax.tree.map(lambda x: x.reshape((ids.shape[0], k) + x.shape[1:]), out)

    if n == 1:
        out = sample(prompt_ids, prompt_mask, key)
    else:
        # Row r's key is its chunk's, r % n: each chunk draws with one key.
        keys = jnp.tile(jax.random.split(key, n), prompt_ids.shape[0] // n)
        out = in_row_chunks(n, lambda ids, mask, row_keys: sample(ids, mask, row_keys[0]),
                            prompt_ids, prompt_mask, keys)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def sampler_logprobs_are_exact(static: PPOStatic) -> bool:
    """In float32 at highest matmul precision without top-k / top-p filtering the sampler's
    logprobs are those of the temperature-scaled policy that training evaluates (to ~1e-5, on
    every backend), so the scoring pass can reuse them instead of running the actor again. In
    bfloat16, or at a lower precision (TF32 on NVIDIA GPUs, bfloat16 passes on TPUs), the two
    programs round differently."""
    return (static.temperature > 0 and static.top_k == 0 and static.top_p >= 1.0
            and static.compute_dtype == "float32" and static.matmul_precision == "highest")


def rollout_mismatch(trainer_logprobs, sampler_logprobs, response_mask, cliprange):
    """How far the sampler's logprobs of the sampled tokens are from the trainer's: mean and max
    |trainer - sampler| over the response tokens, and the share of tokens whose exp(trainer -
    sampler) lies outside PPO's clip range [1 - cliprange, 1 + cliprange] before any update."""
    valid = response_mask != 0
    diff = jnp.where(valid, trainer_logprobs - sampler_logprobs, 0.0)
    ratio = jnp.exp(diff)
    outside = ((ratio < 1.0 - cliprange) | (ratio > 1.0 + cliprange)).astype(jnp.float32)
    # Unmeasured (NaN) logprobs stay NaN in every metric.
    outside = jnp.where(jnp.isnan(diff), jnp.nan, outside)
    return {"rollout/logprob_diff_mean": _masked_mean(jnp.abs(diff), valid),
            "rollout/logprob_diff_max": jnp.abs(diff).max(),
            "rollout/ratio_outside_clip": _masked_mean(outside, valid)}


def sequence_score(static: PPOStatic, models: Models, frozen: Frozen, prompt_ids, prompt_mask,
                   response_ids, response_mask, documents=None, host_scores=None, trunk=None):
    """(score, raw score) `[B]`: the reward model's (normalised when `normalize_reward`), the
    gold function's on `documents`, or the host's `host_scores`, before clipping."""
    if static.reward_source == "host":
        scores = jnp.asarray(host_scores, jnp.float32)
        return scores, scores
    if static.reward_source == "gold":
        scores = models.gold_fn(documents, response_ids, response_mask)
        return scores, scores
    raw = sequence_scores(models.reward, role_params(static, "reward", frozen), prompt_ids,
                          prompt_mask, response_ids, response_mask, trunk)
    if static.normalize_reward:
        return (raw - frozen.reward_mean) / frozen.reward_std, raw
    return raw, raw


def terminal_reward(static: PPOStatic, scores, ended_with_eos):
    """The score as the last token's reward: clipped to +-reward_clip, minus the missing-EOS
    penalty (what `losses.assemble_rewards` adds on the last token)."""
    out = jnp.clip(scores, -static.reward_clip, static.reward_clip)
    if static.missing_eos_penalty:
        out = jnp.where(ended_with_eos, out, out - static.missing_eos_penalty)
    return out


def score(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
          prompt_mask, response_ids, response_mask, documents=None, host_scores=None,
          sampled_logprobs=None, sampled_entropy=None, first_step=None):
    """One scoring pass over sampled responses: (Experience, metrics).

    Old and reference logprobs, critic values, the sequence score (the reward model's, the gold
    function's on `documents`, or `host_scores [B]` computed on the host, e.g. unit tests) and
    the per-token rewards: -kl_coef * KL on every token plus the clipped score on the last one.
    `sampled_logprobs [B, R]` (the sampler's) replace the actor's scoring pass when
    `static.reuses_sampler_logprobs`; where both exist, their mismatch is measured
    (`rollout_mismatch`). Reused where they are not exact, the scoring pass still runs on the
    first step, to measure what the choice costs (NaN on later steps). `first_step`: whether
    this is the first step (default `state.step == 0`); a vmapped caller passes one unbatched
    flag for all its runs, so the extra pass stays a branch taken once (under vmap a batched
    predicate turns `lax.cond` into a select that runs both branches at every step).
    """
    args = (prompt_ids, prompt_mask, response_ids, response_mask)
    trunk = shared_trunk(static, models, role_params(static, "reference", frozen), *args)
    # A shared trunk's states cover the whole batch; the config keeps it and chunks apart.
    n = static.rollout_chunks if trunk is None else 1
    entropies = None if sampled_entropy is None else sampled_entropy * response_mask
    sampler = None if sampled_logprobs is None else sampled_logprobs * response_mask
    trainer_pass = lambda: in_row_chunks(n, lambda *a: token_logprobs(
        models.policy, role_params(static, "actor", frozen, state.actor_params), *a,
        static.temperature, trunk), *args)
    if sampler is not None and static.reuses_sampler_logprobs:
        old_logprobs = sampler
        trainer = None
        if not sampler_logprobs_are_exact(static):
            first = state.step == 0 if first_step is None else first_step
            trainer = jax.lax.cond(first, lambda: trainer_pass()[0],
                                   lambda: jnp.full_like(sampler, jnp.nan))
    else:
        old_logprobs, actor_entropy = trainer_pass()
        trainer = old_logprobs
        entropies = actor_entropy if entropies is None else entropies
    ref = in_row_chunks(n, lambda *a: continuation_scores(
        role_model(static, models, "reference"), role_params(static, "reference", frozen), *a,
        static.temperature, trunk), *args)
    if entropies is None:
        entropies = jnp.zeros_like(old_logprobs)
    if static.uses_critic:
        values, final_values = in_row_chunks(n, lambda *a: critic_outputs(
            models.critic, role_params(static, "critic", frozen, state.critic_params), *a, trunk),
            *args)
    else:
        values = final_values = None
    scores, raw_scores = in_row_chunks(n, lambda *a: sequence_score(
        static, models, frozen, *a, trunk), *args, documents, host_scores)
    ended_with_eos = _ended_with_eos(response_ids, response_mask, static.eos_id)
    rewards, reward_metrics = losses.assemble_rewards(
        old_logprobs, ref.logprobs, scores, response_mask, kl_coef=state.kl_coef,
        kl_estimator=static.kl_estimator, reward_clip=static.reward_clip,
        missing_eos_penalty=static.missing_eos_penalty or None, ended_with_eos=ended_with_eos)
    exp = Experience(prompt_ids, prompt_mask, response_ids, response_mask, old_logprobs,
                     ref.logprobs, ref.base_logprobs,
                     jnp.zeros_like(old_logprobs) if values is None else values, scores, rewards,
                     ended_with_eos, entropies,
                     # Only Monte Carlo branches score again (with the gold function).
                     documents if estimators.ESTIMATORS[static.estimator].branches else None,
                     None if trunk is None else trunk[0],
                     sampler if static.rollout_correction != "none" else None)
    seq_kl = (losses.kl_per_token(old_logprobs, ref.logprobs, "k1") * response_mask).sum(axis=1)
    metrics = {
        "objective/kl": seq_kl.mean(),
        "objective/entropy": (-old_logprobs * response_mask).sum(axis=1).mean(),
        "objective/scores": scores.mean(),
        "objective/raw_scores": raw_scores.mean(),
        "objective/non_score_reward": reward_metrics["non_score_reward"],
        "objective/rlhf_reward": reward_metrics["rlhf_reward"],
        "val/num_eos_tokens": ended_with_eos.sum().astype(jnp.float32),
        "val/response_length": response_mask.sum(axis=1).mean().astype(jnp.float32),
    }
    if final_values is not None:
        # How far the critic is from the reward's scale where the score is read (0 at the first
        # step when the critic starts from the reward model, rescaled to normalised scores).
        metrics["critic/score_value_error"] = jnp.abs(final_values - scores).mean()
    if sampler is not None and trainer is not None:
        metrics.update(rollout_mismatch(trainer, sampler, response_mask, static.cliprange))
    return exp, metrics


def rollout(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen, prompt_ids,
            prompt_mask, key, documents=None, first_step=None):
    """`generate_responses` then `score`: (Experience, metrics). The prompts `[B / group_size,
    P]` (and documents) are repeated to one row per sample."""
    sample = generate_responses(static, models, state, prompt_ids, prompt_mask, key, frozen)
    prompt_ids, prompt_mask, documents = repeat_groups(static, prompt_ids, prompt_mask, documents)
    return score(static, models, state, frozen, prompt_ids, prompt_mask, sample.tokens,
                 sample.mask.astype(jnp.int32), documents, sampled_logprobs=sample.logprobs,
                 sampled_entropy=sample.entropy, first_step=first_step)


def repeat_groups(static: PPOStatic, *arrays):
    """Each row of every array (None passes through) repeated `group_size` times, adjacent."""
    if static.group_size == 1:
        return arrays
    return tuple(None if a is None else jnp.repeat(a, static.group_size, axis=0) for a in arrays)


def _ended_with_eos(response_ids, response_mask, eos_id):
    last = jnp.maximum(response_mask.sum(axis=1) - 1, 0)
    last_tok = jnp.take_along_axis(response_ids, last[:, None], axis=1)[:, 0]
    eos = jnp.atleast_1d(jnp.asarray(eos_id))
    return jnp.isin(last_tok, eos) & (response_mask.sum(axis=1) > 0)


# ---- termination and advantages --------------------------------------------------------------
def segment_ids_for(static: PPOStatic, hparams: RunHparams, exp: Experience, key):
    """Segment ids `[B, R]` of every distinct on-device termination, selected by the variant."""
    terminations = sorted({v[0] for v in static.variants})
    by_name = {}
    for name in terminations:
        if name == "parsing":
            continue
        extra = dict(entropies=exp.entropies, entropy_quantile=static.entropy_quantile) \
            if name == "entropy" else {}
        by_name[name] = termination.segment(
            name, exp.response_mask, key=key, ref_logprobs=exp.ref_base_logprobs,
            n=hparams.ngram, lengths=static.randomized_lengths, repeats=static.randomized_repeats,
            isolate_last=static.isolate_last, **extra)
    return by_name


def advantages_and_returns(static: PPOStatic, hparams: RunHparams, exp: Experience,
                           segments: dict):
    """Macro GAE for the run's variant; `segments` maps termination name -> `[B, R]` ids."""
    results = []
    for term, weighting, aggregation in static.variants:
        results.append(estimators.ESTIMATORS["gae"].advantages(
            exp.values, exp.rewards, exp.response_mask, segments[term], gamma=hparams.gamma,
            lam=hparams.lam, value_weighting=weighting, reward_aggregation=aggregation))
    if len(results) == 1:
        adv, ret = results[0]
    else:
        stacked_adv = jnp.stack([r[0] for r in results])
        stacked_ret = jnp.stack([r[1] for r in results])
        adv, ret = stacked_adv[hparams.variant], stacked_ret[hparams.variant]
    if static.whiten_advantages:
        adv = advantage.whiten(adv, exp.response_mask)
    return adv, ret


def variant_segments(static: PPOStatic, segments: dict, variant):
    """The `[B, R]` segment ids of the run's variant (a traced index into `static.variants`)."""
    names = [v[0] for v in static.variants]
    if len(set(names)) == 1:
        return segments[names[0]]
    return jnp.stack([segments[n] for n in names])[variant]


def critic_free_advantages(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                           hparams: RunHparams, exp: Experience, segments: dict, key):
    """Per-token advantages `[B, R]` without a critic: (advantages, metrics, extra budget), from
    the estimator's record (`estimators.ESTIMATORS`).

    The record's advantage function reads the responses' terminal rewards (clipped score,
    missing-EOS penalty), their per-token KL estimates to the reference at `state.kl_coef`, and
    the per-token rewards (`estimators.AdvantageInputs`). An estimator that branches (macro_mc)
    first samples `mc_rollouts` continuations from up to `mc_branch_points` macro starts of
    the run variant's segments with the current policy, whose mean returns are the values of
    those states (`monte_carlo_returns`).
    """
    estimator = estimators.ESTIMATORS[static.estimator]
    mask = exp.response_mask
    kl = losses.kl_per_token(exp.old_logprobs, exp.ref_logprobs, static.kl_estimator)
    inputs = estimators.AdvantageInputs(
        scores=jnp.where(mask.sum(axis=1) > 0,
                         terminal_reward(static, exp.scores, exp.ended_with_eos), 0.0),
        kl=jnp.where(mask != 0, kl, 0.0), kl_coef=state.kl_coef, rewards=exp.rewards,
        response_mask=mask, group_size=static.group_size)
    if not estimator.branches:
        return estimator.advantages(inputs), {}, {}
    k_points, k_rollouts = jax.random.split(key)
    seg = variant_segments(static, segments, hparams.variant)
    starts, valid = estimators.choose_branch_points(k_points, seg, mask, static.mc_branch_points)
    actor = role_params(static, "actor", frozen, state.actor_params)
    returns, budget = monte_carlo_returns(static, models, actor, frozen, exp, starts, valid,
                                          k_rollouts, state.kl_coef)
    values = returns.mean(axis=-1)
    adv = estimator.advantages(inputs._replace(branches=(starts, valid, values)))
    metrics = {"mc/branch_points_avg": valid.sum(axis=1).astype(jnp.float32).mean(),
               "mc/value_at_start": values[:, 0].mean(),
               "mc/value_std_avg": returns.std(axis=-1).mean()}
    return adv, metrics, budget


def monte_carlo_returns(static: PPOStatic, models: Models, actor_params, frozen: Frozen,
                        exp: Experience, starts, valid, key, kl_coef=0.0):
    """Returns of `mc_rollouts` continuations from each branch point: (`[B, M, m]`, budget).

    Branch point (b, j) is the state after the first `starts[b, j]` response tokens of row b;
    each continuation is sampled by `actor_params` from there (prompt + prefix prefilled once
    per branch point) and its return is its terminal reward (clipped score, missing-EOS
    penalty) minus `kl_coef` x its summed per-token KL to the reference (the tokens it
    sampled, not the prefix), so the mean over the last axis is an unbiased Monte Carlo
    estimate of the state's KL-regularised value. The budget counts the continuation tokens and
    prefills of valid points.
    """
    rows, prefix, flat_valid = estimators.flatten_branches(starts, valid)
    m = static.mc_rollouts
    cont = rollout_engine.continue_responses(
        models.policy, actor_params, exp.prompt_ids[rows], exp.prompt_mask[rows],
        exp.response_ids[rows], exp.response_mask[rows], prefix,
        row_keys=jax.random.split(key, rows.shape[0] * m), num_samples=m,
        temperature=static.temperature, top_k=static.top_k, top_p=static.top_p,
        eos_id=static.eos_id, pad_id=static.pad_id)
    cont_mask = cont.mask.astype(jnp.int32)
    prompt_ids, prompt_mask, documents = (
        None if a is None else jnp.repeat(a[rows], m, axis=0)
        for a in (exp.prompt_ids, exp.prompt_mask, exp.documents))
    cont_scores, _ = sequence_score(static, models, frozen, prompt_ids, prompt_mask, cont.tokens,
                                    cont_mask, documents)
    returns = terminal_reward(static, cont_scores,
                              _ended_with_eos(cont.tokens, cont_mask, static.eos_id))
    sampled = cont_mask * (jnp.arange(cont_mask.shape[1])[None] >= jnp.repeat(prefix, m)[:, None])
    cont_args = (prompt_ids, prompt_mask, cont.tokens, cont_mask)
    ref = continuation_scores(role_model(static, models, "reference"),
                              role_params(static, "reference", frozen), *cont_args,
                              static.temperature)
    if static.reuses_sampler_logprobs:
        actor_logprobs = cont.logprobs
    else:
        actor_logprobs, _ = token_logprobs(models.policy, actor_params, *cont_args,
                                           static.temperature)
    kl = losses.kl_per_token(actor_logprobs, ref.logprobs, static.kl_estimator)
    returns = returns - kl_coef * jnp.where(sampled != 0, kl, 0.0).sum(axis=1)
    used = jnp.repeat(flat_valid, m).astype(jnp.float32)
    generated = ((cont_mask.sum(axis=1) - jnp.repeat(prefix, m)) * used).sum()
    prefilled = ((exp.prompt_mask[rows].sum(axis=1) + prefix) * flat_valid).sum()
    return returns.reshape(starts.shape + (m,)), {
        "budget/generated_tokens": generated.astype(jnp.float32),
        "budget/prefill_tokens": prefilled.astype(jnp.float32)}


def segment_stats(segments, variant, static, mask):
    """`macro/num_macros_avg` (per response) and `macro/len_avg` (tokens per macro) of the
    run's variant."""
    names = [v[0] for v in static.variants]
    seg = jnp.stack([segments[n] for n in names])[variant]
    num = jnp.where(mask.sum(axis=1) > 0, seg.max(axis=1) + 1, 0).astype(jnp.float32)
    length = mask.sum(axis=1).astype(jnp.float32)
    return {"macro/num_macros_avg": num.mean(),
            "macro/len_avg": length.sum() / jnp.maximum(num.sum(), 1.0)}


# ---- update ---------------------------------------------------------------------------------
def update(static: PPOStatic, models: Models, state: PPOState, exp: Experience, adv, ret, key,
           is_weights=None, frozen: Frozen = None):
    """`ppo_epochs` x `num_minibatches` actor and critic updates from advantages and returns
    `[B, R]` (every token carrying its macro's A and G); the actor alone for the critic-free
    estimators (`ret` unused). `is_weights [B, R]`: rollout-correction weights of each token's
    policy-gradient term (None: 1). The estimators whose KL is a loss term (GRPO, Dr. GRPO) add
    beta x the k3 KL to the reference, per token, aggregated as the policy loss. With LoRA the
    gradients are those of the adapters and heads alone, attached to `frozen`'s base."""
    b = static.batch_size
    mb = b // static.num_minibatches
    data = dict(prompt_ids=exp.prompt_ids, prompt_mask=exp.prompt_mask,
                response_ids=exp.response_ids, response_mask=exp.response_mask,
                old_logprobs=exp.old_logprobs, old_values=exp.values, advantages=adv,
                returns=ret)
    if is_weights is not None:
        data["is_weights"] = is_weights
    if static.kl_in_loss:
        data["ref_logprobs"] = exp.ref_logprobs
    # The frozen trunk's output, once for every epoch and minibatch of actor and critic (the
    # scoring pass's, when the experience carries it).
    if exp.trunk is not None and static.shared_trunk_layers:
        trunk = (exp.trunk, static.shared_trunk_layers)
    else:
        trunk = shared_trunk(static, models, state.actor_params, exp.prompt_ids,
                             exp.prompt_mask, exp.response_ids, exp.response_mask)
    if trunk is not None:
        data["trunk"] = trunk[0]
    trunk_of = lambda batch: None if trunk is None else (batch["trunk"], trunk[1])

    # Each loss casts its weights to the compute dtype once per micro-batch, not per layer call.
    def actor_loss(params, batch, rngs=None):
        logprobs, entropy = token_logprobs(
            models.policy, compute_weights(role_params(static, "actor", frozen, params), models.policy.config),
            batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"],
            static.temperature, trunk_of(batch), rngs)
        loss, m = losses.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                         batch["response_mask"], cliprange=static.cliprange,
                                         aggregation=static.loss_aggregation,
                                         is_weights=batch.get("is_weights"))
        m = dict(m, entropy=_masked_mean(entropy, batch["response_mask"]))
        if static.kl_in_loss:
            kl_loss = losses.kl_penalty_loss(logprobs, batch["ref_logprobs"],
                                             batch["response_mask"], kl_coef=state.kl_coef,
                                             aggregation=static.loss_aggregation)
            loss, m = loss + kl_loss, dict(m, kl_loss=kl_loss)
        return loss, m

    def critic_loss(params, batch, rngs=None):
        values = response_values(models.critic,
                                 compute_weights(role_params(static, "critic", frozen, params), models.critic.config),
                                 batch["prompt_ids"], batch["prompt_mask"],
                                 batch["response_ids"], batch["response_mask"], trunk_of(batch),
                                 rngs)
        loss, m = losses.ppo_value_loss(values, batch["old_values"], batch["returns"],
                                        batch["response_mask"],
                                        cliprange_value=static.cliprange_value)
        return static.vf_coef * loss, dict(m, value_loss=loss)

    def token_count(batch):
        return batch["response_mask"].sum()

    def sequence_count(batch):
        return (batch["response_mask"].sum(axis=1) > 0).sum()

    actor_weight = token_count if static.loss_aggregation == "token_mean" else sequence_count
    k = static.grad_accum_steps

    # The adapters' dropout (LoRA with `model.lora.dropout` > 0): one key per minibatch, drawn
    # from the step's update key; actor and critic draw their own masks.
    dropout = models.policy.config.lora_dropout > 0 or (
        static.uses_critic and models.critic.config.lora_dropout > 0)

    def minibatch_step(carry, xs):
        batch, dropout_key = xs if dropout else (xs, None)
        actor_key, critic_key = (None, None) if dropout_key is None else (
            jax.random.fold_in(dropout_key, 0), jax.random.fold_in(dropout_key, 1))
        actor_params, actor_opt, critic_params, critic_opt, skipped = carry
        (a_loss, a_m), a_grads = accumulate_gradients(actor_loss, actor_params, batch, k,
                                                      actor_weight, static.num_layers_unfrozen,
                                                      actor_key)
        actor_params, actor_opt, a_skip = apply_if_finite(
            a_loss, a_grads, actor_params, actor_opt, models.actor_optimizer)
        metrics = {
            "loss/policy_avg": a_loss, "policy/approxkl_avg": a_m["approxkl"],
            "policy/clipfrac_avg": a_m["clipfrac"], "policy/entropy_avg": a_m["entropy"],
            "val/ratio": a_m["ratio_mean"], "val/ratio_var": a_m["ratio_var"],
            "grad/actor_norm": optax.global_norm(a_grads),
        }
        if static.kl_in_loss:
            metrics["loss/kl_avg"] = a_m["kl_loss"]
        if static.uses_critic:
            (c_loss, c_m), c_grads = accumulate_gradients(critic_loss, critic_params, batch, k,
                                                          token_count, static.num_layers_unfrozen,
                                                          critic_key)
            critic_params, critic_opt, c_skip = apply_if_finite(
                c_loss, c_grads, critic_params, critic_opt, models.critic_optimizer)
            skipped = skipped + c_skip
            metrics.update({"loss/value_avg": c_m["value_loss"],
                            "val/clipfrac_avg": c_m["clipfrac"],
                            "grad/critic_norm": optax.global_norm(c_grads)})
        return (actor_params, actor_opt, critic_params, critic_opt, skipped + a_skip), metrics

    def epoch(carry, epoch_key):
        perm = jax.random.permutation(epoch_key, b)
        shuffled = jax.tree.map(
            lambda x: x[perm].reshape((static.num_minibatches, mb) + x.shape[1:]), data)
        if dropout:
            keys = jax.random.split(jax.random.fold_in(epoch_key, 1), static.num_minibatches)
            return jax.lax.scan(minibatch_step, carry, (shuffled, keys))
        return jax.lax.scan(minibatch_step, carry, shuffled)

    carry = (state.actor_params, state.actor_opt_state, state.critic_params,
             state.critic_opt_state, state.skipped_updates)
    carry, metrics = jax.lax.scan(epoch, carry, jax.random.split(key, static.ppo_epochs))
    actor_params, actor_opt, critic_params, critic_opt, skipped = carry
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["objective/advantage_avg"] = _masked_mean(adv, exp.response_mask)
    if static.uses_critic:
        metrics["critic/explained_variance"] = explained_variance(exp.values, ret,
                                                                  exp.response_mask)
        metrics["objective/return_avg"] = _masked_mean(ret, exp.response_mask)
    metrics["train/skipped_updates"] = skipped
    # The rates of this step's first update, at the optimizers' own counts of applied updates
    # (a skipped non-finite update does not count).
    if models.actor_schedule is not None:
        metrics["lr"] = models.actor_schedule(applied_updates(state.actor_opt_state))
    if models.critic_schedule is not None and static.uses_critic:
        metrics["lr_critic"] = models.critic_schedule(
            applied_updates(state.critic_opt_state))
    new_state = state.replace(actor_params=actor_params, actor_opt_state=actor_opt,
                              critic_params=critic_params, critic_opt_state=critic_opt,
                              skipped_updates=skipped)
    return new_state, metrics


def correction_weights(static: PPOStatic, exp: Experience, segments: dict, variant):
    """(`[B, R]` rollout-correction weights or None, metrics): `static.rollout_correction` at
    the level of tokens, responses or the run variant's macros, capped at `rollout_is_cap`."""
    if static.rollout_correction == "none":
        return None, {}
    level = static.rollout_correction
    seg = variant_segments(static, segments, variant) if level == "macro" else None
    args = (exp.old_logprobs, exp.sampler_logprobs, exp.response_mask)
    weights = losses.rollout_correction_weights(*args, level=level, cap=static.rollout_is_cap,
                                                segment_ids=seg)
    uncapped = losses.rollout_correction_weights(*args, level=level, cap=jnp.inf,
                                                 segment_ids=seg)
    valid = exp.response_mask != 0
    return weights, {"rollout/is_weight_mean": _masked_mean(weights, valid),
                     "rollout/is_weight_capped_frac": _masked_mean(
                         uncapped > static.rollout_is_cap, valid)}


def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) over valid tokens (0 when returns are constant)."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    def var(x):
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n
    v_ret = var(returns)
    return jnp.where(v_ret > 0, 1.0 - var(returns - values) / jnp.maximum(v_ret, 1e-12), 0.0)


def _masked_mean(x, mask):
    m = mask.astype(jnp.float32)
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def adapt_kl_coef(static: PPOStatic, kl_coef, kl):
    """The adaptive KL controller of Ziegler et al. (TRL's AdaptiveKLController)."""
    if not static.adaptive_kl:
        return kl_coef
    error = jnp.clip(kl / static.kl_target - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + error * static.batch_size / static.kl_horizon)


# ---- one whole step ---------------------------------------------------------------------------
def step_keys(state: PPOState):
    """(sample, segment, update) keys of this step: a pure function of the base key and step."""
    base = jax.random.wrap_key_data(state.key)
    return jax.random.split(jax.random.fold_in(base, state.step), 3)


def rollout_phase(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
                  prompt_ids, prompt_mask, documents=None, first_step=None):
    """The first half of a step: (Experience, rollout metrics). `first_step`: see `score`."""
    return rollout(static, models, state, frozen, prompt_ids, prompt_mask, step_keys(state)[0],
                   documents, first_step)


def generate_phase(static: PPOStatic, models: Models, state: PPOState, prompt_ids,
                   prompt_mask, frozen: Frozen = None):
    """The sampling part of `rollout_phase` alone, for steps with host work in between (parsing
    termination, host-computed rewards): a `SampleOutput`."""
    return generate_responses(static, models, state, prompt_ids, prompt_mask,
                              step_keys(state)[0], frozen)


def update_phase(static: PPOStatic, models: Models, state: PPOState, exp: Experience,
                 roll_metrics: dict, hparams: RunHparams, host_segments=None, frozen=None):
    """The second half: termination, macro GAE, updates, KL controller. (state, metrics).

    `host_segments` (`[B, R]` int32) are the parsing termination's segment ids, computed on the
    host from the sampled text between the two phases.
    """
    _, k_segment, k_update = step_keys(state)
    segments = segment_ids_for(static, hparams, exp, k_segment)
    if host_segments is not None:
        segments["parsing"] = host_segments
    budget = {"budget/generated_tokens": exp.response_mask.sum().astype(jnp.float32),
              # Each prompt is prefilled once for its group of samples.
              "budget/prefill_tokens": exp.prompt_mask.sum().astype(jnp.float32)
              / static.group_size}
    if static.uses_critic:
        adv, ret = advantages_and_returns(static, hparams, exp, segments)
        est_metrics = {}
    else:
        ret = None
        adv, est_metrics, branch_budget = critic_free_advantages(
            static, models, state, frozen, hparams, exp, segments,
            jax.random.fold_in(k_segment, 1))
        budget = {k: v + branch_budget.get(k, 0.0) for k, v in budget.items()}
    weights, weight_metrics = correction_weights(static, exp, segments, hparams.variant)
    new_state, upd_metrics = update(static, models, state, exp, adv, ret, k_update, weights,
                                    frozen)
    new_state = new_state.replace(
        step=state.step + 1,
        kl_coef=adapt_kl_coef(static, state.kl_coef, roll_metrics["objective/kl"]),
        generated_tokens=state.generated_tokens + budget["budget/generated_tokens"],
        prefill_tokens=state.prefill_tokens + budget["budget/prefill_tokens"])
    metrics = {**roll_metrics, **upd_metrics, **est_metrics, **budget, **weight_metrics,
               **segment_stats(segments, hparams.variant, static, exp.response_mask),
               "objective/kl_coef": state.kl_coef,
               "budget/generated_tokens_total": new_state.generated_tokens}
    return new_state, metrics


def ppo_step(static: PPOStatic, models: Models, state: PPOState, frozen: Frozen,
             hparams: RunHparams, prompt_ids, prompt_mask, documents=None, first_step=None):
    """rollout -> termination -> macro GAE -> update, for on-device terminations. `first_step`:
    see `score`."""
    exp, roll_metrics = rollout_phase(static, models, state, frozen, prompt_ids, prompt_mask,
                                      documents, first_step)
    return update_phase(static, models, state, exp, roll_metrics, hparams, frozen=frozen)
