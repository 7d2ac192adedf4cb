"""The types of a PPO / MA-PPO step and the roles of its models.

    PPOStatic    what is fixed at compile time (hashable): shapes, sampling, loss settings
    RunHparams   what arms of an experiment vary, traced (a leading run axis when vmapped)
    PPOState     what a step updates: actor and critic params and optimizer states, key, counts
    Frozen       what a step reads and never updates: reference, reward model, score statistics
    Experience   the scored rollout between the phases (`train/phases/`)
    PartialBatch a batch the asynchronous sampler is decoding (`train/async_step.py`)
    Models       the modules and optimizers (static)

`role_params` / `role_model` say which params and module each of the four roles (actor,
critic, reward model, reference) applies; every phase takes them from there.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax

from marl_jax import estimators
from marl_jax.models import lora


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
    # The policy objective (`losses.ppo_policy_loss`, resolved by `estimators.objective`): the
    # ratio's unit and form, the clip ranges (None: `cliprange`), dual clip (None: off).
    ratio_level: str = "token"
    ratio_form: str = "product"
    cliprange_low: Any = None
    cliprange_high: Any = None
    dual_clip: Any = None
    # Dynamic sampling: m x the prompts of a step are sampled and the first batch_size /
    # group_size groups whose rewards differ are trained on (1: off).
    dynamic_sampling_oversample: int = 1
    # DAPO's soft overlong punishment (`losses.overlong_penalty`; buffer 0: off), and whether
    # responses that hit the budget without EOS leave the loss.
    overlong_buffer: int = 0
    overlong_penalty: float = 0.0
    # The budget the overlong penalty counts a row's action tokens against
    # (`estimators.action_budget`; 0: response_length).
    action_budget: int = 0
    mask_truncated: bool = False
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
    # low_probability termination: the lowest-probability fraction of tokens end macros, or
    # (threshold > 0) the tokens of probability below the threshold do.
    low_probability_quantile: float = 0.2
    low_probability_threshold: float = 0.0
    # step termination: the delimiters' tables over the tokenizer's vocabulary
    # (`macro.steps.StepTable`, hashed by content); None when nothing cuts at reasoning steps.
    step_table: Any = None
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
    # Asynchronous PPO (`train/async_schedule.py`): the sampler runs up to `max_staleness`
    # versions ahead (0: synchronous); tokens more than `max_token_staleness` versions old at
    # their update leave the loss (-1: no limit).
    max_staleness: int = 0
    max_token_staleness: int = -1

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
        needs the trainer's; never when asynchronous, where the old logprobs are the proximal
        policy's (the actor being trained) and the sampler's are older versions'."""
        if self.max_staleness:
            return False  # the sampler's logprobs are older versions'
        if self.old_logprobs == "auto":
            return sampler_logprobs_are_exact(self) and self.rollout_correction == "none"
        return self.old_logprobs == "sampler"

    @property
    def groups_per_step(self) -> int:
        """Prompts trained on per step: `batch_size` rows are `group_size` samples of each."""
        return self.batch_size // self.group_size

    @property
    def prompts_per_step(self) -> int:
        """Prompts sampled per step: those trained on, `dynamic_sampling_oversample` times."""
        return self.groups_per_step * self.dynamic_sampling_oversample


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
    """The scored rollout a step trains on. Every leaf has the leading row axis `[B, ...]`,
    which the phase programs split over the batch axes: scalars of a rollout travel in its
    metrics. A multi-turn trajectory is the same rollout with observation spans among the
    response tokens: the forward passes read them, nothing else does (`actions`)."""

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
    # [B] bool: the rows that enter the loss (dynamic sampling masks a shortfall of informative
    # groups); None: every row.
    loss_rows: Any = None
    # A multi-turn trajectory (None: one response). `response_mask` then marks every token
    # after the prompt that the forward passes read (actions and observations), `action_mask`
    # [B, R] the policy's tokens (holes at the observation spans), `turn_ids` [B, R] the turn of
    # each token (non-decreasing along a row).
    action_mask: Any = None
    turn_ids: Any = None
    # [B, R] the environment's reward of each turn on its last action token (in `rewards`
    # too); what a trajectory earned besides its sequence score, which the estimators that
    # read one score per response add to it.
    turn_rewards: Any = None
    # [B, R] int32 the policy version that sampled each action token (`async_schedule`: the
    # actor after that many updates), -1 where no policy sampled (observations, padding).
    versions: Any = None

    @property
    def actions(self):
        """`[B, R]` the policy's tokens: what the KL, the rewards, the advantages and the losses
        see (`response_mask` for one response)."""
        return self.response_mask if self.action_mask is None else self.action_mask


@flax.struct.dataclass
class PartialBatch:
    """A batch in the asynchronous sampler (`train/async_step.py`): one row per response (the
    samples of a prompt adjacent, prompts repeated), responses decoded so far, each token with
    the version that sampled it. A row holds a prompt of the batch's step, or one carried over
    from an earlier batch (partial rollouts)."""

    prompt_ids: jax.Array  # [B, P] left-padded
    prompt_mask: jax.Array  # [B, P]
    tokens: jax.Array  # [B, R] int32, pad after the response
    mask: jax.Array  # [B, R] int32, 1 on the tokens sampled so far (up to and including EOS)
    logprobs: jax.Array  # [B, R] the sampler's (its version's), 0 elsewhere
    entropy: jax.Array  # [B, R]
    versions: jax.Array  # [B, R] int32, -1 where nothing is sampled yet
    documents: Any = None  # [B, D] the synthetic task's documents (gold scores)


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


def sampler_logprobs_are_exact(static: PPOStatic) -> bool:
    """In float32 at highest matmul precision without top-k / top-p filtering the sampler's
    logprobs are those of the temperature-scaled policy that training evaluates (to ~1e-5, on
    every backend), so the scoring pass can reuse them instead of running the actor again. In
    bfloat16, or at a lower precision (TF32 on NVIDIA GPUs, bfloat16 passes on TPUs), the two
    programs round differently."""
    return (static.temperature > 0 and static.top_k == 0 and static.top_p >= 1.0
            and static.compute_dtype == "float32" and static.matmul_precision == "highest")


def step_keys(state: PPOState):
    """(sample, segment, update) keys of this step: a pure function of the base key and step."""
    base = jax.random.wrap_key_data(state.key)
    return jax.random.split(jax.random.fold_in(base, state.step), 3)
