"""The config check: `validate_config` raises one line naming the first bad field of a config
(`marl_jax.config`) before anything compiles.

It reads the rules of the algorithms from their modules: each estimator's record
(`estimators.ESTIMATORS`: samples per prompt, what it scores on), the loss aggregations and
rollout corrections of `losses`, the macro value weightings and reward aggregations of
`macro.advantage`, LoRA's targets of `models.lora`. `marl_jax.config` itself only builds and
edits configs.
"""
from __future__ import annotations

import importlib.util
import netrc
import os
import re
import sys
from urllib.parse import urlparse

import ml_collections

from marl_jax.config import (
    CALCULATOR_TASK_FIELDS,
    GAME_TASK_FIELDS,
    REASONING_GYM_TASK_FIELDS,
    REVIEW_TASK_FIELDS,
    SYNTHETIC_TASK_FIELDS,
    TASK_CONFIGS,
    base_config,
    get_field,
    remat_policy,
)
from marl_jax.estimators import ESTIMATORS, action_budget, objective
from marl_jax.losses import (KL_ESTIMATORS, POLICY_AGGREGATIONS, RATIO_FORMS, RATIO_LEVELS,
                             ROLLOUT_CORRECTIONS)
from marl_jax.macro.advantage import REWARD_AGGREGATIONS, VALUE_WEIGHTINGS
from marl_jax.macro.steps import delimiters_problem
from marl_jax.models import lora
from marl_jax.xla_flags import MODES as XLA_GPU_FLAG_MODES

STAGES = ("sft", "rm", "ppo", "all", "experiment", "eval", "async_study")
TERMINATIONS = ("fixed", "randomized", "perplexity", "entropy", "low_probability", "step",
                "parsing", "turn")
SCHEDULES = ("constant", "linear", "cosine")
CRITIC_INITS = ("rm", "sft", "random")
DTYPES = ("float32", "bfloat16", "float16")
# The model's numerics knobs (marl_jax/models/config.py has their meaning).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash")
MATMUL_PRECISIONS = ("default", "high", "highest")
SAMPLER_LAYOUTS = ("auto", "train", "unrolled", "fused")
OLD_LOGPROBS = ("auto", "trainer", "sampler")
WANDB_MODES = ("online", "offline", "disabled")
WANDB_INSTALL = "pip install -e \".[wandb]\" -c requirements/lock.txt"


def validate_config(c: ml_collections.ConfigDict, *, config_file: str = "") -> None:
    """Raises ValueError naming the first bad field; call before anything compiles.

    `config_file` (the file `c` came from) only makes messages more specific.
    """
    def check(cond, field, msg):
        if not cond:
            raise ValueError(f"config.{field}={get_field(c, field)!r}: {msg}")

    check(c.stage in STAGES, "stage", f"must be one of {STAGES}")
    check(c.stage != "async_study" or "async_study" in c, "stage",
          "the study needs the config's async_study section (arms, variants, baseline): use "
          "--config=configs/async_synthetic.py")
    _check_task_fields(c, config_file)
    if c.task.name == "reasoning_gym":
        _check_reasoning_gym(c.task, c.sft.steps, check)
    check(isinstance(c.tpu_topology, str) and re.fullmatch(r"([a-z0-9]+-[0-9]+)?", c.tpu_topology),
          "tpu_topology", "must be empty or a Cloud TPU slice like v4-16, v5litepod-8, v5p-32")
    check(c.model.dtype in ("auto",) + DTYPES, "model.dtype", f"must be auto or one of {DTYPES}")
    check(c.model.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}")
    check(remat_policy(c.model.remat) in REMAT_POLICIES, "model.remat",
          f"must be one of {REMAT_POLICIES} (True means full, False none)")
    check(c.model.get("attention", "auto") in ATTENTION_IMPLEMENTATIONS, "model.attention",
          f"must be one of {ATTENTION_IMPLEMENTATIONS}")
    check(c.model.get("matmul_precision", "auto") in ("auto",) + MATMUL_PRECISIONS, "model.matmul_precision",
          f"must be one of {('auto',) + MATMUL_PRECISIONS}")
    check(c.model.get("sampler_layout", "auto") in SAMPLER_LAYOUTS, "model.sampler_layout",
          f"must be one of {SAMPLER_LAYOUTS}")
    check(c.model.get("xla_gpu_flags", "auto") in XLA_GPU_FLAG_MODES, "model.xla_gpu_flags",
          f"must be one of {XLA_GPU_FLAG_MODES}")
    check(not (c.model.get("sampler_layout") == "fused" and c.model.get("lora", {}).get("rank", 0)),
          "model.sampler_layout", "fused projections take no LoRA adapters: use unrolled (or auto) with "
          "model.lora.rank > 0")
    check(not (c.model.get("attention") == "cudnn" and c.model.dtype == "float32"), "model.attention",
          "cuDNN's flash attention computes in bfloat16 or float16 only: set model.dtype=bfloat16, "
          "or use attention=auto")
    _check_lora(c, check)
    p = c.ppo
    check(p.termination in TERMINATIONS, "ppo.termination", f"must be one of {TERMINATIONS}")
    _check_multi_turn(c, check)
    _check_credit(c, check)
    check(isinstance(p.ngram, int) and p.ngram >= 1, "ppo.ngram", "must be an integer >= 1")
    check(p.value_weighting in VALUE_WEIGHTINGS, "ppo.value_weighting",
          f"must be one of {VALUE_WEIGHTINGS}")
    check(p.reward_aggregation in REWARD_AGGREGATIONS, "ppo.reward_aggregation",
          f"must be one of {REWARD_AGGREGATIONS}")
    check(p.kl_estimator in KL_ESTIMATORS, "ppo.kl_estimator", f"must be one of {KL_ESTIMATORS}")
    check(p.critic_init in CRITIC_INITS, "ppo.critic_init", f"must be one of {CRITIC_INITS}")
    check(p.reward_source in ("rm", "gold", "host", "env"), "ppo.reward_source",
          "must be rm, gold, host or env")
    check(p.loss_aggregation in ("auto",) + POLICY_AGGREGATIONS, "ppo.loss_aggregation",
          f"must be one of {('auto',) + POLICY_AGGREGATIONS}")
    check(p.old_logprobs in OLD_LOGPROBS, "ppo.old_logprobs", f"must be one of {OLD_LOGPROBS}")
    check(p.rollout_correction in ROLLOUT_CORRECTIONS, "ppo.rollout_correction",
          f"must be one of {ROLLOUT_CORRECTIONS}")
    check(p.rollout_correction != "turn" or multi_turn_task(c), "ppo.rollout_correction",
          f"turn weighs each turn of a multi-turn trajectory; task {c.task.name!r} trains single "
          "responses (use sequence)")
    check(isinstance(p.rollout_is_cap, (int, float)) and p.rollout_is_cap >= 1,
          "ppo.rollout_is_cap", "must be a number >= 1 (the largest importance weight)")
    check(p.rollout_correction == "none" or p.old_logprobs != "sampler", "ppo.old_logprobs",
          f"ppo.rollout_correction={p.rollout_correction!r} weighs the trainer's old logprobs "
          "against the sampler's: use trainer or auto")
    check(len(p.randomized_lengths) > 0 and all(int(x) >= 1 for x in p.randomized_lengths),
          "ppo.randomized_lengths", "must be a non-empty tuple of integers >= 1")
    check(p.randomized_repeats >= 1, "ppo.randomized_repeats", "must be >= 1")
    problem = termination_problem(p, p.temperature)
    check(problem is None, *(problem or (None, None)))
    check(p.temperature >= 0, "ppo.temperature", "must be >= 0")
    check(0 < p.top_p <= 1, "ppo.top_p", "must be in (0, 1]")
    check(p.top_k >= 0, "ppo.top_k", "must be >= 0 (0 disables top-k)")
    check(isinstance(p.decode_slots, int) and p.decode_slots >= 0, "ppo.decode_slots",
          "must be an integer >= 0 (0: one static batch)")
    check(isinstance(p.get("phase_timing", True), bool), "ppo.phase_timing",
          "must be True (the phases as programs of their own, timed) or False (one program)")
    check(0 <= p.lam <= 1, "ppo.lam", "must be in [0, 1]")
    check(0 <= p.gamma <= 1, "ppo.gamma", "must be in [0, 1]")
    check(p.kl_coef >= 0, "ppo.kl_coef", "must be >= 0")
    check(p.cliprange > 0, "ppo.cliprange", "must be > 0")
    check(p.cliprange_value > 0, "ppo.cliprange_value", "must be > 0")
    check(p.response_length >= 1, "ppo.response_length", "must be >= 1")
    check(p.ppo_epochs >= 1, "ppo.ppo_epochs", "must be >= 1")
    check(isinstance(p.eval_samples_per_prompt, int) and p.eval_samples_per_prompt >= 1,
          "ppo.eval_samples_per_prompt", "must be an integer >= 1")
    check(p.num_minibatches >= 1 and p.batch_size % p.num_minibatches == 0,
          "ppo.num_minibatches", f"must divide ppo.batch_size={p.batch_size}")
    for stage in ("sft", "rm", "ppo"):
        s = c[stage]
        check(s.steps >= 0, f"{stage}.steps", "must be >= 0")
        check(s.batch_size >= 1, f"{stage}.batch_size", "must be >= 1")
        check(isinstance(s.grad_accum_steps, int) and s.grad_accum_steps >= 1,
              f"{stage}.grad_accum_steps", "must be an integer >= 1")
        check(s.learning_rate > 0, f"{stage}.learning_rate", "must be > 0")
        check(s.schedule in SCHEDULES, f"{stage}.schedule", f"must be one of {SCHEDULES}")
        check(0 <= s.warmup_ratio < 1, f"{stage}.warmup_ratio", "must be in [0, 1)")
        n = s.get("num_layers_unfrozen", -1)
        check(isinstance(n, int) and n >= -1, f"{stage}.num_layers_unfrozen",
              "must be an int >= 0 (layers trained from the top) or -1 (every parameter)")
        check(n < 0 or not c.model.get("scan_layers", False), f"{stage}.num_layers_unfrozen",
              "needs unrolled decoder layers: set config.model.scan_layers=False")
    check(isinstance(c.rm.get("group_by_prompt", False), bool), "rm.group_by_prompt",
          "must be True or False")
    for stage in ("sft", "rm"):
        s = c[stage]
        check(s.batch_size % s.grad_accum_steps == 0, f"{stage}.grad_accum_steps",
              f"must divide {stage}.batch_size={s.batch_size}")
    # PPO splits each of its minibatches into the micro-batches.
    check(p.batch_size % (p.num_minibatches * p.grad_accum_steps) == 0, "ppo.grad_accum_steps",
          f"ppo.num_minibatches * ppo.grad_accum_steps = {p.num_minibatches} * "
          f"{p.grad_accum_steps} must divide ppo.batch_size={p.batch_size}")
    chunks = p.get("rollout_chunks", 1)
    check(isinstance(chunks, int) and chunks >= 1 and p.batch_size % (chunks * p.group_size) == 0,
          "ppo.rollout_chunks", "must be an integer >= 1 dividing ppo.batch_size / "
          "ppo.group_size (prompts per step)")
    if isinstance(chunks, int) and chunks >= 1 and isinstance(p.decode_slots, int):
        chunk_rows = p.batch_size // chunks
        check(p.decode_slots < chunk_rows or p.decode_slots == 0, "ppo.decode_slots",
              f"must be below the {chunk_rows} responses of one rollout chunk (ppo.batch_size="
              f"{p.batch_size} / ppo.rollout_chunks={chunks}) to refill slots; use at most "
              f"{chunk_rows // 2} or 0 (one static batch)")
    check(chunks == 1 or p.get("num_layers_unfrozen", -1) < 0, "ppo.rollout_chunks",
          "scores the whole batch at once when a frozen trunk is shared (num_layers_unfrozen): "
          "use 1")
    check(p.estimator in ESTIMATORS, "ppo.estimator", f"must be one of {tuple(ESTIMATORS)}")
    check(isinstance(p.group_size, int) and p.group_size >= 1 and p.batch_size % p.group_size == 0,
          "ppo.group_size", f"must be an integer >= 1 dividing ppo.batch_size={p.batch_size}")
    least = ESTIMATORS[p.estimator].min_group_size
    check(p.group_size >= least, "ppo.group_size",
          f"ppo.estimator={p.estimator!r} compares each response with the other samples of its "
          f"prompt: set ppo.group_size >= {least} (and ppo.batch_size a multiple of it)")
    check(isinstance(p.mc_rollouts, int) and p.mc_rollouts >= 1, "ppo.mc_rollouts",
          "must be an integer >= 1")
    check(isinstance(p.mc_branch_points, int) and p.mc_branch_points >= 0,
          "ppo.mc_branch_points", "must be an integer >= 0 (0: every macro start)")
    check(not ESTIMATORS[p.estimator].branches or p.reward_source in ("rm", "gold"),
          "ppo.reward_source", f"{p.estimator} scores its branches on device: use rm or gold")
    _check_objective(p, check, action_budget(c))
    _check_async(c, check)
    _warn_once(rollout_correction_warning(p))
    check(c.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
    if "seeds" in c:
        check_seeds(c.seeds)
    if "eval" in c:
        check(isinstance(c.eval.get("allow_unfiltered_jail", False), bool),
              "eval.allow_unfiltered_jail", "must be True or False")
    if "logging" in c:
        _check_logging(c.logging)
    for axis in ("data", "fsdp", "tensor"):
        v = c.mesh[axis]
        check(isinstance(v, int) and (v >= 1 or v == -1), f"mesh.{axis}",
              "must be a positive integer or -1 (all remaining devices)")
    check(sum(c.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) <= 1, "mesh",
          "at most one mesh axis may be -1")


def _check_objective(p, check, budget):
    """The policy objective's fields (`estimators.objective`: each unset one is the estimator's
    record's), with the values they resolve to in the messages; `budget` is the action budget
    the overlong penalty counts against (`estimators.action_budget`)."""
    check(p.get("ratio_level", "auto") in ("auto",) + RATIO_LEVELS, "ppo.ratio_level",
          f"must be one of {('auto',) + RATIO_LEVELS}")
    check(p.get("ratio_form", "auto") in ("auto",) + RATIO_FORMS, "ppo.ratio_form",
          f"must be one of {('auto',) + RATIO_FORMS}")
    for field in ("cliprange_low", "cliprange_high", "dual_clip", "overlong_penalty"):
        check(p.get(field, None) is None or isinstance(p[field], (int, float)), f"ppo.{field}",
              "must be a number (or unset)")
    for field in ("dynamic_sampling_oversample", "overlong_buffer"):
        check(p.get(field, None) is None or (isinstance(p[field], int)
                                             and not isinstance(p[field], bool)),
              f"ppo.{field}", f"must be an integer (or unset), got {p.get(field)!r}")
    check(isinstance(p.get("mask_truncated", False), bool), "ppo.mask_truncated",
          "must be True or False")
    o = objective(p, budget)
    check(o.cliprange_low > 0, "ppo.cliprange_low", "must be > 0 (the ratio is clipped below at "
          "1 - cliprange_low)")
    check(o.cliprange_high > 0, "ppo.cliprange_high", "must be > 0 (the ratio is clipped above "
          "at 1 + cliprange_high)")
    check(o.cliprange_high >= o.cliprange_low, "ppo.cliprange_high",
          f"the upper clip range {o.cliprange_high} is below the lower one {o.cliprange_low} "
          f"(ppo.estimator={p.estimator!r}, ppo.cliprange={p.cliprange}): clip-higher needs "
          "cliprange_high >= cliprange_low")
    check(o.dual_clip is None or o.dual_clip > 1, "ppo.dual_clip",
          "must be > 1 (a negative advantage's loss is bounded by dual_clip x |A|), or unset")
    check(not (o.ratio_level == "macro" and p.termination == "fixed" and p.ngram == 1),
          "ppo.ratio_level", "macro ratios need macro actions, but ppo.termination='fixed' with "
          "ppo.ngram=1 makes every token its own macro: use token, or ppo.ngram > 1")
    m = o.dynamic_sampling_oversample
    problem = dynamic_sampling_problem(p.estimator, p.get("dynamic_sampling_oversample", None))
    check(problem is None, "ppo.dynamic_sampling_oversample", problem)
    if m > 1:
        check(p.group_size >= 2, "ppo.group_size",
              f"dynamic sampling (ppo.dynamic_sampling_oversample={m}, ppo.estimator="
              f"{p.estimator!r}) keeps the groups whose rewards differ: set ppo.group_size >= 2")
        check(p.reward_source in ("rm", "gold") and p.termination != "parsing",
              "ppo.dynamic_sampling_oversample",
              f"dynamic sampling (m={m}) selects groups on device: use ppo.reward_source rm or "
              "gold and an on-device termination (not parsing)")
    check(o.overlong_buffer >= 0, "ppo.overlong_buffer", "must be >= 0 (0: no overlong penalty)")
    check(o.overlong_buffer < budget, "ppo.overlong_buffer",
          f"the overlong buffer ({o.overlong_buffer} tokens) must be below the action budget "
          f"{budget} (ppo.response_length={p.response_length}; on an environment's task at most "
          "task.max_turns x task.max_turn_tokens)")
    check(o.overlong_penalty >= 0, "ppo.overlong_penalty",
          "must be >= 0 (it is subtracted from the score)")


def _check_async(c, check):
    """Asynchronous PPO (`config.rollout`, `marl_jax.train.async_schedule`): the staleness
    bounds, the decode chunk, a device split of disjoint index sets, and the settings the
    asynchronous loop cannot serve, each named. Whether the devices exist is checked where the
    meshes are built (`async_schedule.device_split`), before anything compiles."""
    if "rollout" not in c:
        return
    r, p = c.rollout, c.ppo

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    k = r.max_staleness
    check(is_int(k) and k >= 0, "rollout.max_staleness",
          "must be an integer >= 0 (0: the synchronous step; k: the sampler runs up to k "
          "policy versions ahead of the trainer)")
    limit = r.get("max_token_staleness")
    check(limit is None or (is_int(limit) and limit >= k), "rollout.max_token_staleness",
          f"must be an integer >= rollout.max_staleness={k} (a batch's own tokens are up to k "
          "versions old), or unset (no limit)")
    check(is_int(r.chunk_tokens) and 0 <= r.chunk_tokens <= p.response_length,
          "rollout.chunk_tokens", f"must be an integer in [0, ppo.response_length="
          f"{p.response_length}] (0: the response budget split evenly over the k chunks)")
    for field in ("sampler_devices", "trainer_devices"):
        indices = r[field]
        check(isinstance(indices, (tuple, list)) and all(is_int(i) and i >= 0 for i in indices)
              and len(set(indices)) == len(indices), f"rollout.{field}",
              "must be a tuple of distinct device indices >= 0 (into jax.devices())")
    both = sorted(set(r.sampler_devices) & set(r.trainer_devices))
    check(not both, "rollout.sampler_devices",
          f"devices {both} are also in rollout.trainer_devices={tuple(r.trainer_devices)}: the "
          "sampler and the trainer take disjoint sets")
    check(not r.trainer_devices or r.sampler_devices, "rollout.trainer_devices",
          "set rollout.sampler_devices too (both empty: one set of devices, interleaved)")
    if not k:
        check(not r.sampler_devices, "rollout.sampler_devices",
              "the synchronous step (rollout.max_staleness=0) samples and trains on the same "
              "devices: set rollout.max_staleness >= 1 to split them")
        return
    unserved = (
        (c.stage in ("ppo", "all"), "stage", f"the asynchronous loop runs stage ppo or all; "
         f"stage {c.stage!r} vmaps synchronous steps: use rollout.max_staleness=0"),
        (not multi_turn_task(c) or not r.chunk_tokens, "rollout.chunk_tokens", "a multi-turn "
         f"task's trajectories are split over the k chunks by turns (task {c.task.name!r}): "
         "use 0"),
        (not multi_turn_task(c) or not r.sampler_devices, "rollout.sampler_devices", "a "
         f"multi-turn task (task {c.task.name!r}) plays its episodes in threads beside the "
         "trainer, on its devices: use ()"),
        (not multi_turn_task(c) or not p.decode_slots, "ppo.decode_slots", "a multi-turn "
         "task's asynchronous turns prefill their whole history again each turn, in one batch: "
         "use 0"),
        (p.termination != "parsing", "ppo.termination", "parsing runs on the host between the "
         "phases, which the asynchronous loop does not stop for: use an on-device termination "
         "or rollout.max_staleness=0"),
        (p.reward_source != "host", "ppo.reward_source", "host rewards are computed between "
         "the phases, which the asynchronous loop does not stop for: use rm or gold, or "
         "rollout.max_staleness=0"),
        (p.get("rollout_chunks", 1) == 1, "ppo.rollout_chunks", "the asynchronous loop decodes "
         "a batch's chunks at once: use 1"),
        (objective(p).dynamic_sampling_oversample == 1, "ppo.dynamic_sampling_oversample",
         f"dynamic sampling (m={objective(p).dynamic_sampling_oversample} under ppo.estimator="
         f"{p.estimator!r}) selects among a step's own samples; the asynchronous loop samples "
         "each batch ahead, prompt by prompt: set 1 (or rollout.max_staleness=0)"),
        (p.old_logprobs != "sampler", "ppo.old_logprobs", "the asynchronous loop clips against "
         "the proximal policy, the trainer's own logprobs (the sampler's are older versions'): "
         "use trainer or auto"),
    )
    for ok, field, why in unserved:
        check(ok, field, f"rollout.max_staleness={k}: {why}")


def dynamic_sampling_problem(estimator: str, oversample):
    """Why `ppo.dynamic_sampling_oversample` = `oversample` (None: the record's) cannot run
    under `estimator`, or None. It is an integer m >= 1 (1: off); m > 1 drops the groups whose
    scores are all equal, which carry no signal only where the estimator is group-normalised
    (`estimators.Estimator.group_normalised`)."""
    if oversample is None:
        oversample = ESTIMATORS[estimator].dynamic_sampling_oversample
    if not isinstance(oversample, int) or isinstance(oversample, bool) or oversample < 1:
        return (f"must be an integer >= 1, got {oversample!r} (m > 1: m x the prompts a step "
                "trains on are sampled; 1: no dynamic sampling)")
    if oversample == 1 or ESTIMATORS[estimator].group_normalised:
        return None
    return (f"dynamic sampling (m={oversample}) drops the groups whose scores are all equal, "
            f"which carry no signal only under a group-normalised estimator ({GROUP_NORMALISED});"
            f" under ppo.estimator={estimator!r} they still do, and dropping them selects on the "
            "reward: set ppo.dynamic_sampling_oversample=1")


def termination_problem(p, temperature) -> tuple[str, str] | None:
    """(`ppo.<field>`, one line) for the first termination setting of `p` (`config.ppo`, or an
    experiment arm's fields) that cannot work, else None: an unknown termination, a quantile or
    threshold out of range, or a rule that reads what the run does not have (`low_probability`
    cuts at the tokens sampled with low probability; greedy decoding, `temperature` 0, samples
    none, every old logprob is that of a point mass)."""
    def share(name, low_open=True):
        value = p[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and (0 < value <= 1 if low_open else 0 <= value <= 1)

    rules = (
        ("termination", p["termination"] in TERMINATIONS, f"must be one of {TERMINATIONS}"),
        ("entropy_quantile", share("entropy_quantile"), "must be in (0, 1]"),
        ("low_probability_quantile", share("low_probability_quantile"), "must be in (0, 1]"),
        ("low_probability_threshold", share("low_probability_threshold", low_open=False),
         "must be in [0, 1] (0: ppo.low_probability_quantile decides)"),
        ("step_delimiters", delimiters_problem(p["step_delimiters"]) is None,
         delimiters_problem(p["step_delimiters"])),
        ("termination", not (p["termination"] == "low_probability" and temperature == 0),
         "low_probability cuts after the tokens the policy sampled with low probability, but "
         "ppo.temperature=0 decodes greedily (no sampled probabilities): use a temperature > 0"),
    )
    for field, ok, message in rules:
        if not ok:
            return f"ppo.{field}", message
    return None


def parsing_problem(c) -> tuple[str, str] | None:
    """(field, one line) when the parsing termination cannot run for the probe's `credit.rules`
    (`marl_jax.macro.parsing`, as the PPO step runs it with `config.ppo`'s parsing knobs), else
    None: spaCy and the pipeline `ppo.parsing_model` installed, a cutoff >= 2. The tokenizer
    is checked where the parser is built (`parsing.IncrementalDecoder` reads a fast tokenizer's
    text, which every single-response task's tokenizer is)."""
    p, keep = c.ppo, "or keep credit.rules to the rules cut on the device"
    if importlib.util.find_spec("spacy") is None:
        return "credit.rules", f"parsing parses the responses with spaCy: pip install spacy, {keep}"
    if not _spacy_pipeline_installed(p.parsing_model):
        return "ppo.parsing_model", (
            f"credit.rules has parsing, which parses the responses with this spaCy pipeline; it "
            f"is not installed: python -m spacy download {p.parsing_model}, {keep}")
    cutoff = p.parsing_cutoff
    if not (isinstance(cutoff, int) and not isinstance(cutoff, bool) and cutoff >= 2):
        return "ppo.parsing_cutoff", "must be an integer >= 2 (a subtree of fewer tokens is a macro)"
    return None


def _spacy_pipeline_installed(model) -> bool:
    """Whether `spacy.load(model)` finds a pipeline: an installed package or a directory."""
    if not isinstance(model, str) or not model:
        return False
    if os.path.isdir(model):
        return True
    try:
        return importlib.util.find_spec(model) is not None
    except (ImportError, ValueError):  # a dotted or otherwise unimportable name
        return False


def check_seeds(seeds) -> None:
    """Raises one line unless `seeds` (`config.seeds`: one PPO run per arm and seed) is a
    non-empty sequence of distinct integers: a seed listed twice would run the same runs twice
    and count them as two replicates in every interval over seeds."""
    values = tuple(seeds) if isinstance(seeds, (tuple, list)) else (seeds,)
    if not values or not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise ValueError(f"config.seeds={seeds!r}: must be a non-empty tuple of integers, "
                         "e.g. --config.seeds='(0,1,2,3)'")
    repeated = sorted({s for s in values if values.count(s) > 1})
    if repeated:
        raise ValueError(f"config.seeds={seeds!r}: seed(s) {', '.join(map(str, repeated))} "
                         "listed more than once; every seed must be distinct")


# The estimators under which dynamic sampling drops only groups of zero advantage.
GROUP_NORMALISED = ", ".join(name for name, e in ESTIMATORS.items() if e.group_normalised)
# Longest macro (tokens) above which macro-level correction weights under top-k / top-p warn.
LONG_MACRO = 32
# The kept probability mass per token that `rollout_correction_warning` illustrates with.
KEPT_MASS = 0.99
_warned: set = set()


def rollout_correction_warning(p) -> str | None:
    """One line when `config.ppo`'s rollout correction multiplies many tokens' weights under
    top-k / top-p, else None.

    The sampler renormalises its probabilities over the tokens top-k / top-p keep, so each
    token's ratio pi_trainer / pi_sampler is at most 1 (the kept mass) and a product over L
    tokens shrinks geometrically: "sequence" multiplies a whole response's, "macro" a macro's
    (fixed n-grams of n tokens; randomized lengths up to the rest of the response after the
    list). Terminations whose macro lengths depend on the samples are not bounded here.
    """
    if p.rollout_correction not in ("sequence", "macro") or (p.top_k == 0 and p.top_p >= 1):
        return None
    length = int(p.response_length)
    if p.rollout_correction == "macro":
        if p.termination == "fixed":
            length = min(int(p.ngram), length)
        elif p.termination == "randomized":
            listed = [int(x) for x in p.randomized_lengths] * int(p.randomized_repeats)
            length = min(max(max(listed), length - sum(listed)), length)
        else:
            return None
        if length <= LONG_MACRO:
            return None
    unit = "response" if p.rollout_correction == "sequence" else "macro"
    return (f"warning: config.ppo.rollout_correction={p.rollout_correction!r} under "
            f"top_k={p.top_k}, top_p={p.top_p}: the sampler renormalises over the kept tokens, "
            f"so every token's weight is at most 1 and a {unit}'s weight, their product over "
            f"up to {length} tokens, shrinks geometrically ({KEPT_MASS} kept per token gives "
            f"{KEPT_MASS ** length:.2g}); use token, or macro with macros of at most "
            f"{LONG_MACRO} tokens")


def _warn_once(line: str | None) -> None:
    """`line` on stderr, once per process (the config is checked again by later stages)."""
    if line is not None and line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr, flush=True)


def _check_lora(c, check):
    """The LoRA fields that need no model; `marl_jax.models.lora.check` checks the rank against
    the projections once the architecture is known (before anything compiles)."""
    if "lora" not in c.model:
        return
    lo = c.model.lora
    check(isinstance(lo.rank, int) and lo.rank >= 0, "model.lora.rank",
          "must be an integer >= 0 (0 = full fine-tuning)")
    check(lo.alpha > 0, "model.lora.alpha", "must be > 0")
    check(0.0 <= lo.dropout < 1.0, "model.lora.dropout",
          "must be in [0, 1): the probability of dropping an input of the adapters")
    check(isinstance(lo.get("weight_decay", 0.0), (int, float))
          and lo.get("weight_decay", 0.0) >= 0, "model.lora.weight_decay",
          "must be a number >= 0 (the adapters' AdamW weight decay; PEFT / TRL use 0)")
    if lo.rank:
        lora.check(lo.rank, tuple(lo.targets) or lora.TARGETS, None)
        for stage in ("sft", "rm", "ppo"):
            check(c[stage].get("num_layers_unfrozen", -1) < 0, f"{stage}.num_layers_unfrozen",
                  "LoRA trains adapters on every layer: use -1 with model.lora.rank > 0")
        check(c.rm.init_from == "sft", "rm.init_from",
              "LoRA trains the reward model's adapters on the SFT base: use sft")
        check(c.ppo.critic_init in ("rm", "sft"), "ppo.critic_init",
              "LoRA trains the critic's adapters on the shared base: use rm or sft")
        check(c.stage != "experiment", "stage",
              "experiments (arms vmapped over seeds) run full fine-tuning: set model.lora.rank=0")


def _check_logging(logging_cfg) -> None:
    """W&B fields, the package and its credentials: a run that would fail at its first metrics
    row fails here instead, before anything compiles."""
    if not isinstance(logging_cfg.wandb, bool):
        raise ValueError(f"config.logging.wandb={logging_cfg.wandb!r}: must be True or False")
    mode = logging_cfg.wandb_mode
    if mode not in WANDB_MODES:
        raise ValueError(f"config.logging.wandb_mode={mode!r}: must be one of {WANDB_MODES}")
    if not logging_cfg.wandb:
        return
    if not logging_cfg.wandb_project:
        raise ValueError("config.logging.wandb_project='': name the W&B project")
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(f"config.logging.wandb=True needs the wandb package: {WANDB_INSTALL}")
    if mode == "online" and not _wandb_credentials():
        raise ValueError("config.logging.wandb_mode='online' needs W&B credentials: run "
                         "`wandb login` (or set WANDB_API_KEY), or choose "
                         "--config.logging.wandb_mode=offline")


def _wandb_credentials() -> bool:
    """Whether W&B finds credentials without asking: WANDB_API_KEY, an identity token file, or
    a netrc entry for its host (where `wandb login` writes the key)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def multi_turn_task(c) -> bool:
    """Whether `config.task` is an environment's (trained on multi-turn trajectories)."""
    from marl_jax.envs import environment_names

    return c.task.name in environment_names()


# The tasks whose gold the probe can compute: the synthetic task's on device, the review task's
# on decoded text (`marl_jax.eval.review_gold`).
TASKS_WITH_GOLD = ("synthetic", "reviews")


def _check_credit(c, check):
    """The advantage-quality probe (`config.credit`, off at every = 0): its sizes, rules and
    weightings, a critic to score (token and macro GAE read the run's values), and sampled
    logprobs and entropies for the rules that read them."""
    if "credit" not in c or not c.credit.every:
        return
    r, p = c.credit, c.ppo
    for field, least, why in (("every", 0, " (0: off)"),
                              ("continuations", 2, ": the noise ceiling compares two halves"),
                              ("prompts", 2, ": intervals resample prompts"),
                              ("group_size", 2, ": GRPO's and RLOO's groups"),
                              ("chunk_states", 1, ""), ("mc_rollouts", 1, "")):
        value = r[field]
        check(isinstance(value, int) and value >= least, f"credit.{field}",
              f"must be an integer >= {least}{why}")
    rules = tuple(r.rules)
    # On a multi-turn task the rules cut within turns, and `turn` is one more.
    on_device = tuple(t for t in TERMINATIONS if t not in ("parsing", "turn")) + (
        ("turn",) if multi_turn_task(c) else ())
    check(not multi_turn_task(c) or "parsing" not in rules, "credit.rules",
          "parsing reads single responses; on a multi-turn task the probe takes the rules cut on "
          "the device (within turns) and turn")
    check(bool(rules) and set(rules) <= {*on_device, "parsing"}, "credit.rules",
          f"must be a non-empty subset of {on_device} (the rules cut on the device) and "
          "parsing (parsed on the host)")
    problem = parsing_problem(c) if "parsing" in rules else None
    check(problem is None, *(problem or (None, None)))
    check(bool(tuple(r.weightings)) and set(r.weightings) <= set(VALUE_WEIGHTINGS),
          "credit.weightings", f"must be a non-empty subset of {VALUE_WEIGHTINGS}")
    check(p.estimator == "gae", "credit.every",
          f"the probe scores the run's critic: ppo.estimator must be gae, not {p.estimator!r}")
    check(c.stage in ("ppo", "all"), "credit.every",
          f"the probe runs inside a PPO run (stage ppo or all), not stage {c.stage!r}")
    check(not ({"low_probability", "entropy"} & set(rules)) or p.temperature > 0, "credit.rules",
          "entropy and low_probability read sampled probabilities: ppo.temperature must be > 0")
    check(p.reward_source in ("rm", "gold") or multi_turn_task(c), "credit.every",
          f"the ground truth rescoring needs reward_source rm or gold, not {p.reward_source!r}")
    truth = r.get("truth", "reward")
    check(truth in ("reward", "gold"), "credit.truth", "must be reward or gold")
    check(truth != "gold" or c.task.name in TASKS_WITH_GOLD, "credit.truth",
          f"gold needs a task with a gold ({', '.join(TASKS_WITH_GOLD)}); task "
          f"{c.task.name!r} has none")


def _check_multi_turn(c, check):
    """A multi-turn task's rewards are its environment's and its rollouts are played from the
    host; the turn termination and the environment's reward need such a task."""
    p, t = c.ppo, c.task
    if not multi_turn_task(c):
        check(p.termination != "turn", "ppo.termination",
              f"turn (one macro per assistant turn) needs multi-turn trajectories; task "
              f"{t.name!r} trains single responses")
        check(p.reward_source != "env", "ppo.reward_source",
              f"env (an environment's rewards) needs a multi-turn task; task {t.name!r} has no "
              "environment")
        return
    check(p.reward_source == "env", "ppo.reward_source",
          f"task {t.name!r} is an environment: its rewards are the environment's (use env)")
    for name in ("max_turns", "max_turn_tokens", "max_observation_tokens"):
        value = t.get(name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
              f"task.{name}", "must be an integer >= 1")
    check(c.stage != "eval", "stage",
          f"task {t.name!r} is evaluated by its ppo stage (the held-out return in every eval "
          "row); the eval stage samples single responses")
    check(p.termination != "parsing", "ppo.termination",
          "parsing reads single responses; on a multi-turn task use a rule cut on the device "
          f"(within turns: {', '.join(n for n in TERMINATIONS if n != 'parsing')})")
    check(p.eval_samples_per_prompt == 1, "ppo.eval_samples_per_prompt",
          f"task {t.name!r} is evaluated by one episode per held-out prompt (its return is the "
          "gold): use 1")
    check(not (ESTIMATORS[p.estimator].needs_critic and p.critic_init == "rm"),
          "ppo.critic_init", f"task {t.name!r} has no reward model to start the critic from: "
          "use sft or random")
    from marl_jax.envs.tasks import WORD_TOKENIZER, game_problem, tokenizer_problem

    problem = game_problem(c)
    check(problem is None, *(problem or (None, None)))
    problem = tokenizer_problem(c)
    if problem is not None:  # the field may be absent: the word-level tokenizer by default
        raise ValueError(f"config.task.tokenizer={t.get('tokenizer', WORD_TOKENIZER)!r}: "
                         f"{problem}")


def _check_reasoning_gym(t, sft_steps, check):
    """The reasoning-gym task's dataset and options against the library's registry (imports
    the library, 2-3 s, which the task's build needs next; reads no file), its answer format,
    and with an SFT stage the reference answers it trains on (one entry generated)."""
    from marl_jax.envs import reasoning_gym

    try:
        reasoning_gym.library()
    except ValueError as error:
        raise ValueError(f"config.task.name='reasoning_gym': {error}") from None
    problem = reasoning_gym.dataset_problem(t.dataset)
    check(problem is None, "task.dataset", problem)
    options = t.options.to_dict() if isinstance(t.options, ml_collections.ConfigDict) else None
    problem = "must be a dict of the dataset's options, e.g. " \
        "--config.task.options=\"{'max_terms': 2}\"" if options is None else \
        reasoning_gym.options_problem(t.dataset, options)
    if problem is not None:  # the field's own repr spans lines (a ConfigDict)
        shown = options if options is not None else t.options
        raise ValueError(f"config.task.options={shown!r}: {problem}")
    check(t.answer_format in reasoning_gym.ANSWER_FORMATS, "task.answer_format",
          f"must be one of {tuple(reasoning_gym.ANSWER_FORMATS)}")
    if sft_steps:
        problem = reasoning_gym.reference_problem(t.dataset, options)
        check(problem is None, "sft.steps", problem)


def _check_task_fields(c, config_file):
    """A task name whose section lacks the fields its task reads fails here, naming them and the
    config file that serves the task, rather than deep inside data loading."""
    name = c.task.name
    if name not in TASK_CONFIGS:
        raise ValueError(f"config.task.name={name!r}: must be one of {tuple(TASK_CONFIGS)}")
    needed = {"synthetic": SYNTHETIC_TASK_FIELDS, "reviews": REVIEW_TASK_FIELDS,
              "calculator": CALCULATOR_TASK_FIELDS, "game": GAME_TASK_FIELDS,
              "reasoning_gym": REASONING_GYM_TASK_FIELDS}.get(name, tuple(base_config().task))
    missing = [f for f in needed if f not in c.task]
    if missing:
        kind = {"synthetic": "synthetic", "reviews": "review", "calculator": "calculator",
                "game": "game", "reasoning_gym": "reasoning-gym"}.get(name, "real-dataset")
        raise ValueError(
            f"config.task.name={name!r} needs the {kind} task fields ({', '.join(missing)}) that "
            f"{config_file or 'this config'} does not have; use --config={TASK_CONFIGS[name]}")
