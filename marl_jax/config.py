"""The one config system: `ml_collections.ConfigDict`s built by files in configs/ on top of
`base_config()`, overridden on the command line, validated by
`marl_jax.config_check.validate_config` before anything compiles.

Defaults of the PPO section are the released MA-RLHF TL;DR Gemma-2B run: batch 256 prompts,
1 PPO epoch, clip 0.2 / 0.2, lam 0.95, gamma 1, kl_coef 0.05, reward clip 2.5, Adam (0.9, 0.95),
weight decay 0.1, linear LR 1.5e-5 with 5% warmup, grad clip 1.0, prompt / response 512 / 512,
temperature 0.8, top-k 50, top-p 1, fixed 5-gram macros with `equal` weighting and the official
`weighted` reward aggregation.
"""
from __future__ import annotations

import difflib
import importlib.util

import ml_collections

# The config file that serves each task name: real datasets need the task fields of
# `base_config()`, which configs/synthetic.py replaces with the synthetic world's.
TASK_CONFIGS = {
    "synthetic": "configs/synthetic.py",
    "tldr": "configs/tldr_smollm2.py",
    "hh_rlhf": "configs/hh_rlhf_smollm2.py",
    "webgpt": "configs/webgpt_smollm2.py",
    "apps": "configs/apps_smollm2.py",
    "reviews": "configs/real_text_smollm2.py",
    "calculator": "configs/multiturn_synthetic.py",
    "game": "configs/game_smollm2.py",
    "reasoning_gym": "configs/rlvr_smollm2.py",
}
# What marl_jax/data/tasks.py reads of the synthetic task section besides the world's fields.
SYNTHETIC_TASK_FIELDS = ("data_seed", "num_sft", "num_pairs", "num_rl_prompts",
                         "num_eval_prompts")
# What marl_jax/envs/tasks.py reads of the calculator task's section.
CALCULATOR_TASK_FIELDS = ("data_seed", "num_sft", "num_rl_prompts", "num_eval_prompts",
                          "prompt_length", "max_turns", "min_a", "max_a", "max_bc", "max_value",
                          "demo_shortcut")
# What marl_jax/envs/tasks.py reads of the game task's section.
GAME_TASK_FIELDS = ("environment", "tokenizer", "data_seed", "num_rl_prompts", "num_eval_prompts",
                    "prompt_length", "max_turns", "max_turn_tokens", "max_observation_tokens")
# What marl_jax/envs/tasks.py reads of the reasoning-gym task's section.
REASONING_GYM_TASK_FIELDS = ("dataset", "options", "answer_format", "tokenizer", "data_seed",
                             "num_sft", "num_rl_prompts", "num_eval_prompts", "prompt_length",
                             "max_turns", "max_turn_tokens", "max_observation_tokens")
# What marl_jax/data/review_task.py and the pipeline read of the review task's section.
REVIEW_TASK_FIELDS = ("data_seed", "tokenizer", "max_prompt_length", "use_chat_template",
                      "num_eval_prompts", "num_rm_eval", "num_sft", "num_pairs",
                      "num_rl_prompts", "samples_per_prompt", "annotator_temperature",
                      "gold_min_words", "gold_max_words", "pairs_per_prompt",
                      "sample_batch_size")


def optimizer_config(lr: float, steps: int, batch_size: int) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        steps=steps,
        batch_size=batch_size,
        grad_accum_steps=1,  # micro-batches per optimizer update (batch_size is their total)
        learning_rate=lr,
        warmup_ratio=0.05,
        schedule="linear",
        b1=0.9,
        b2=0.95,
        weight_decay=0.1,
        grad_clip=1.0,
        # Train only the top n decoder layers, the final norm and the heads (trlx's
        # num_layers_unfrozen; needs model.scan_layers=False); -1 trains every parameter.
        num_layers_unfrozen=-1,
    ))


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.stage = "all"
    c.seed = 0
    c.seeds = (0, 1, 2)
    c.checkpoint_every = 100
    c.log_every = 1
    c.max_to_keep = 2
    # The Cloud TPU slice this config is sized for, e.g. "v4-16" (`experiments/bench.py memory`
    # compiles for it); empty = none.
    c.tpu_topology = ""

    # Mesh axes (data, fsdp, tensor); -1 takes all remaining devices (at most one -1).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # Multi-host: empty coordinator = single process, or automatic on Cloud TPU VMs.
    c.distributed = ml_collections.ConfigDict(dict(coordinator="", num_processes=0,
                                                   process_id=-1))

    # The task: "synthetic", or a real dataset (tldr, hh_rlhf, webgpt, apps); see
    # marl_jax/data/real_tasks.py for how a real dataset becomes SFT / RM / RL / eval arrays.
    c.task = ml_collections.ConfigDict(dict(
        name="synthetic",
        path="",             # local dataset directory; empty = the hub name through `datasets`
        tokenizer="",        # tokenizer path; empty = config.model.path
        cache_dir="",        # `datasets` cache; empty = its default
        max_rows=0,          # read only the first rows of each split (0 = all)
        max_prompt_length=512,
        use_chat_template=False,
        # The paper's SFT / RM / RL split of the training rows (DeepSpeed-Chat "2,4,4").
        split_fractions=(0.2, 0.4, 0.4),
        split_seed=1234,
        # Held-out prompts: "" = the dataset's validation / test split when it has one, else the
        # last prompts of the RL part; or "validation", "test", "heldout".
        eval_split="",
        # Caps on the number of examples of each part (0 = all).
        num_sft=0,
        num_pairs=0,
        num_rl_prompts=0,
        num_eval_prompts=256,
        include_cnndm=False,  # tldr: keep the CNN/DailyMail rows of the validation split
        difficulties=(),      # apps: a subset of (introductory, interview, competition); () = all
        unit_test_timeout_s=4.0,  # apps: wall-clock budget per test case of a generated program
        unit_test_workers=0,      # apps: programs run in parallel (0 = one per CPU, memory allowing)
        unit_test_memory_mb=2048,  # apps: address space of each process of a generated program
        sandbox="bubblewrap",     # apps: jail of generated programs: bubblewrap | namespaces (weaker)
    ))

    # The policy / reference model: a pretrained checkpoint (HF directory or .gguf file) or,
    # when `path` is empty, a fresh decoder built from `config` (ModelConfig fields).
    c.model = ml_collections.ConfigDict(dict(
        path="",
        dtype="auto",        # compute dtype: auto = bfloat16 on GPU / TPU, float32 on CPU
        param_dtype="float32",
        # Rematerialisation of each layer in the backward pass: none | full | dots | dots_no_batch
        # (MaxText's nothing_saveable, checkpoint_dots, checkpoint_dots_with_no_batch_dims);
        # True means full, False none.
        remat="none",
        scan_layers=False,   # one `scan` over the decoder layers (MaxText's scan_layers)
        # Whole-sequence attention (training, scoring, prefill): auto | reference | xla | cudnn |
        # splash (marl_jax/models/attention.py); auto takes cuDNN's flash attention on NVIDIA GPUs
        # and the splash kernel on TPUs where they apply, the reference einsums elsewhere.
        attention="auto",
        # Precision of every dot and einsum of every role, sampling and scoring alike: auto
        # (highest in float32, default in bfloat16) | default | high | highest.
        matmul_precision="auto",
        # The layout the sampler decodes with (marl_jax/models/decode_layout.py): auto | train |
        # unrolled | fused; auto = fused (layers unrolled, q / k / v and gate / up one matmul each)
        # on NVIDIA GPUs, unrolled there with LoRA adapters (or KV heads that do not divide the
        # tensor axis), the training layout elsewhere.
        sampler_layout="auto",
        # XLA flags for every GPU program of the process (marl_jax/xla_flags.py): auto = command
        # buffers that capture while loops and conditionals on NVIDIA GPUs; none = XLA's defaults.
        xla_gpu_flags="auto",
        config=ml_collections.ConfigDict(),
        # LoRA (marl_jax/models/lora.py): rank 0 = full fine-tuning. With rank r > 0 every stage
        # trains float32 adapters (and its heads) on one frozen base, scaled by alpha / r, on the
        # projections in `targets` (() = every one the architecture has: q, k, v, o, gate, up,
        # down). `dropout`: PEFT's lora_dropout, on the adapters' inputs in the training
        # forwards of every stage (masks drawn from the seed and the step, so resume is exact).
        # `merge_sft`: the SFT adapter is merged into the base the later stages start
        # from; False keeps it apart (every role's adapters attach to the pretrained base, the
        # reference is that base with the SFT adapter, frozen, the actor a copy of it).
        # `weight_decay`: the adapters' AdamW weight decay in every stage (PEFT / TRL LoRA
        # recipes: 0); the heads keep their stage's `weight_decay`.
        lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets=(),
                                            merge_sft=True, weight_decay=0.0)),
    ))

    c.sft = optimizer_config(lr=1e-5, steps=1000, batch_size=32)
    c.sft.num_examples = 0  # 0 = every example of the task's SFT split

    c.rm = optimizer_config(lr=1e-5, steps=1000, batch_size=32)
    c.rm.num_examples = 0
    c.rm.init_from = "sft"  # the paper initialises the reward model from the SFT policy
    # True: a batch is `rm.batch_size` prompts with every pair of their responses (InstructGPT:
    # each response scored once per step, all K-choose-2 comparisons of a prompt in the loss);
    # False: `rm.batch_size` pairs.
    c.rm.group_by_prompt = False

    p = c.ppo = optimizer_config(lr=1.5e-5, steps=1000, batch_size=256)
    p.critic_learning_rate = 1.5e-5
    p.rollout_chunks = 1  # sample the prompts in this many sequential chunks (KV-cache memory)
    p.ppo_epochs = 1
    p.num_minibatches = 1
    p.response_length = 512
    p.temperature = 0.8
    p.top_k = 50
    p.top_p = 1.0
    # Rollouts (PPO and evaluation) over this many decode slots: continuous batching, the same
    # samples, a KV cache of decode_slots rows instead of batch_size; 0: one static batch.
    p.decode_slots = 0
    # Run the step as its four phases' programs (rollout, score, advantages, update), each
    # waited on, so every row says where the step's time went (`timing/<phase>_s`); False: the
    # step as one program (docs/accelerators.md has what the split costs).
    p.phase_timing = True
    # Macro actions.
    p.termination = "fixed"
    p.ngram = 5
    p.randomized_lengths = (2, 3, 5, 10)
    p.randomized_repeats = 3
    p.entropy_quantile = 0.2  # entropy termination: share of tokens (top entropy) starting macros
    # low_probability termination (SAE): the share of each response's tokens, those of lowest
    # sampled probability, after which a macro ends (0.2: macros of 5 tokens on average, as
    # MA-RLHF's 5-grams); or, when low_probability_threshold > 0, every token whose probability
    # is below that threshold ends one (0: the quantile decides).
    p.low_probability_quantile = 0.2
    p.low_probability_threshold = 0.0
    # step termination: a macro ends at the token holding a delimiter's first character in the
    # decoded response (reasoning steps: a newline or a sentence end; ASCII strings).
    p.step_delimiters = ("\n", ". ", "? ", "! ")
    p.parsing_cutoff = 5
    p.parsing_model = "en_core_web_sm"
    p.isolate_last = True
    p.value_weighting = "equal"
    p.reward_aggregation = "weighted"
    # Rewards, KL and advantages.
    p.kl_coef = 0.05
    p.kl_estimator = "k1"
    p.adaptive_kl = False
    p.kl_target = 6.0
    p.kl_horizon = 10000
    p.reward_clip = 2.5
    p.normalize_reward = True
    p.missing_eos_penalty = 0.0  # > 0: subtracted from the score of responses with no EOS
    p.gamma = 1.0
    p.lam = 0.95
    p.whiten_advantages = False
    # Losses.
    p.cliprange = 0.2
    # The policy objective (marl_jax/losses.py `ppo_policy_loss`; "auto" / unset: the
    # estimator's record in `estimators.ESTIMATORS`, e.g. gspo: sequence, geometric, 3e-4 /
    # 4e-4). The unit whose ratio is clipped: token (PPO), macro (the MA-RLHF paper: a macro
    # action's ratio, clipped once with its advantage) or sequence (GSPO); how its tokens'
    # ratios combine: product or geometric (their geometric mean).
    p.ratio_level = "auto"
    p.ratio_form = "auto"
    # Clip ranges 1 - cliprange_low, 1 + cliprange_high (DAPO's clip-higher); unset: the
    # record's, else `cliprange`.
    p.cliprange_low = ml_collections.config_dict.placeholder(float)
    p.cliprange_high = ml_collections.config_dict.placeholder(float)
    # Dual-clip PPO (Ye et al., 2019): c > 1 bounds the loss of a negative advantage by c |A|;
    # unset: off.
    p.dual_clip = ml_collections.config_dict.placeholder(float)
    # Dynamic sampling (DAPO; group_size >= 2): m > 1 samples m x batch_size / group_size
    # prompts a step and trains on the first batch_size / group_size groups whose rewards are
    # not all equal (a shortfall is masked out of the loss); the group-normalised estimators
    # only (grpo, dr_grpo, gspo, dapo), where such a group has zero advantage. 1: off (dapo's
    # own ablation); unset: the record's (dapo: 3), else off.
    p.dynamic_sampling_oversample = ml_collections.config_dict.placeholder(int)
    # DAPO's soft overlong punishment: a penalty rising linearly over the last
    # `overlong_buffer` tokens of the response budget up to `overlong_penalty`, subtracted from
    # the score; unset: the record's (dapo: 1/5 of the budget, 1.0), else off (0).
    p.overlong_buffer = ml_collections.config_dict.placeholder(int)
    p.overlong_penalty = ml_collections.config_dict.placeholder(float)
    # Responses that hit the budget without EOS leave the loss (DAPO's overlong filtering).
    p.mask_truncated = False
    p.cliprange_value = 0.2
    p.vf_coef = 0.5
    # auto: the estimator's published aggregation (its record in `estimators.ESTIMATORS`);
    # token_mean, sequence_mean (GRPO) or token_sum (Dr. GRPO) for every arm.
    p.loss_aggregation = "auto"
    # The sampler and the trainer compute the same policy in different programs: in bfloat16, or
    # under top-k / top-p, their logprobs of the sampled tokens differ. old_logprobs: trainer
    # (one scoring pass of the actor), sampler (the sampler's, no extra pass), or auto (trainer
    # unless compute is float32 without top-k / top-p, where the two are the same numbers).
    p.old_logprobs = "auto"
    # Truncated importance weights min(pi_trainer / pi_sampler, cap) on each token's
    # policy-gradient term: none, or the ratio of the token, the whole response, or the macro.
    p.rollout_correction = "none"
    p.rollout_is_cap = 2.0
    p.critic_init = "rm"  # rm (the paper), sft, or random (a cold critic)
    # rm (the paper); gold: the synthetic task's gold function as an oracle reward model;
    # host: a reward computed on the host, e.g. the fraction of APPS unit tests passed.
    p.reward_source = "rm"
    # Advantages (marl_jax/estimators.py): gae (macro GAE with a critic: PPO / MA-PPO) or a
    # critic-free estimator: grpo, dr_grpo, rloo (group baselines over `group_size` >= 2 samples
    # of each prompt), reinforce_pp (REINFORCE++), macro_mc (Monte Carlo values of macro starts
    # from `mc_rollouts` continuations at up to `mc_branch_points` of them per response).
    p.estimator = "gae"
    p.group_size = 1  # samples per prompt; batch_size counts responses (prompts x group_size)
    p.mc_rollouts = 4
    p.mc_branch_points = 4  # 0: every macro start
    # Experiments only: arm name -> ppo fields that arm sets beyond its definition (e.g. the
    # group size or batch size of a critic-free arm, configs/synthetic_estimators.py).
    p.arm_overrides = ml_collections.ConfigDict()
    p.eval_every = 10
    # Responses sampled per held-out prompt at each evaluation (the prompt prefilled once): a
    # prompt's gold is the mean over its m samples, which divides the sampling noise of a paired
    # per-prompt difference by about sqrt(m); KL and RM score are those of its first sample.
    p.eval_samples_per_prompt = 1

    # Asynchronous PPO (marl_jax/train/async_schedule.py, docs/async.md). max_staleness k: the
    # sampler runs up to k policy versions ahead of the trainer (0: the synchronous step); each
    # response is decoded in chunks of `chunk_tokens` tokens (0: ceil(response_length / k); a
    # multi-turn trajectory's chunks are ceil(max_turns / k) turns), one version per chunk, the
    # weights swapped between chunks; a response unfinished after its k chunks continues in a
    # later batch. A token sampled more than `max_token_staleness` versions
    # before the update that trains it gets no loss weight (unset: no limit; at least k). The
    # sampler and the trainer on disjoint devices (indices into jax.devices()): () and () share
    # every device, the loop interleaving them; trainer_devices () = every device not sampling.
    c.rollout = ml_collections.ConfigDict(dict(
        max_staleness=0,
        max_token_staleness=ml_collections.config_dict.placeholder(int),
        chunk_tokens=0,
        sampler_devices=(),
        trainer_devices=(),
    ))

    # Where the metrics rows go besides <workdir>/metrics.jsonl and TensorBoard: Weights & Biases
    # (the run's config once, then every row), from process 0.
    c.logging = ml_collections.ConfigDict(dict(
        wandb=False,
        wandb_project="marl_jax",
        wandb_entity="",   # empty = the account's default entity
        wandb_name="",     # empty = W&B's generated run name
        wandb_mode="online",  # online | offline (files under $WANDB_DIR, sync later) | disabled
    ))

    # `--config.stage=eval`: the SFT and final PPO policies of a workdir on held-out prompts.
    c.eval = ml_collections.ConfigDict(dict(
        max_prompts=0,       # held-out prompts used (0 = all of the task's eval prompts)
        batch_size=0,        # prompts sampled at once (0 = config.ppo.batch_size)
        # Pairwise judge of policy vs SFT: rm (the trained reward model), gold (the synthetic
        # task's gold reward), openai (an OpenAI-compatible chat endpoint), none.
        judge="rm",
        judge_max_samples=50,  # pairs shown to the openai judge (the paper: 50); 0 = all
        judge_template="",     # tldr, hh or a custom template; empty = by task
        base_url="",           # empty = $MARL_JUDGE_BASE_URL, else https://api.openai.com/v1
        model="",              # empty = $MARL_JUDGE_MODEL
        api_key="",            # empty = $OPENAI_API_KEY
        judge_workers=8,
        judge_timeout_s=60.0,
        num_samples=5,         # apps: samples per problem for pass@k
        # apps: the namespaces jail (task.sandbox) may run without its seccomp filter where
        # libseccomp / pyseccomp is missing (programs may then reach host Unix sockets).
        allow_unfiltered_jail=False,
        pass_at_k=(1, 5),
        histogram_bins=30,
    ))

    # Advantage quality (`marl_jax.credit`): every `every` PPO steps (and at step 0), one
    # rollout of the first `prompts` held-out prompts, `group_size` samples each, on which every
    # estimator's advantages are scored against Monte Carlo ground truth (`continuations`
    # samples from every state of every response). 0: off.
    c.credit = ml_collections.ConfigDict(dict(
        every=0,
        truth="reward",        # what the truth's continuations earn: the run's per-token reward
                               # (KL terms and score), or "gold": the task's gold on the last
                               # token, no KL (tasks with a gold: synthetic, reviews)
        prompts=8,
        group_size=4,          # samples per prompt: GRPO's and RLOO's groups
        continuations=8,       # K >= 2 per state (two halves give the noise ceiling)
        chunk_states=256,      # states per continuation call
        rules=("fixed", "randomized", "perplexity", "entropy", "low_probability"),
        weightings=("equal", "first"),
        mc_rollouts=4,         # the Monte Carlo macro-value estimator's own continuations
        seed=1234,
    ))
    return c


def remat_policy(value) -> str:
    """`config.model.remat` as a policy name: True / "True" mean full, False / "False" none."""
    return {True: "full", False: "none", "True": "full", "False": "none", "true": "full",
            "false": "none"}.get(value, value) if isinstance(value, (bool, str)) else value


def resolve_size(config, file_config=None, overridden=None):
    """Applies the preset of `config.size` from `config.sizes` (configs/real_text_smollm2.py:
    `--config.size=cpu` or `accelerator`), in place; returns `config`.

    `config.sizes.<size>` mirrors the config's sections (e.g. `ppo.batch_size`). A field set on
    the command line keeps its value, so `--config.size=accelerator --config.ppo.steps=10` runs
    10 steps: the fields of `overridden` (dotted, as `command_line_fields` lists them), or, when
    that is None, the fields whose value differs from `file_config`'s (the config file as
    written). Configs without `size` are returned unchanged; a config is resolved once
    (`config.size_applied`).
    """
    if "size" not in config:
        return config
    sizes = config.get("sizes", None)
    if sizes is None or config.size not in sizes:
        raise ValueError(f"config.size={config.size!r}: must be one of "
                         f"{tuple(sorted(sizes)) if sizes is not None else ()}")
    if config.get("size_applied", "") == config.size:
        return config
    for dotted, value in _flatten(sizes[config.size]):
        try:
            current = get_field(config, dotted)
        except (KeyError, AttributeError):
            raise ValueError(f"config.sizes.{config.size}.{dotted}: config.{dotted} does not "
                             "exist") from None
        if overridden is not None:
            if dotted in overridden:
                continue
        elif file_config is not None and current != get_field(file_config, dotted):
            continue  # set on the command line
        set_field(config, dotted, value)
    config.size_applied = config.size
    return config


def command_line_fields(argv):
    """(the config file `argv` names or None, the dotted fields it overrides: "ppo.ngram")."""
    config_file, fields = None, []
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            config_file = argv[i + 1]
        elif arg.startswith("--config."):
            fields.append(arg[len("--config."):].split("=", 1)[0])
    return config_file, fields


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """The config of the file at `path` as written, before command-line overrides."""
    spec = importlib.util.spec_from_file_location("_marl_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def check_fields_exist(c, dotted_fields) -> None:
    """Raises ValueError naming the first of `dotted_fields` ("ppo.ngram", as overridden on the
    command line) that config `c` does not have, with the nearest existing field of its section."""
    for dotted in dotted_fields:
        section, path = c, "config"
        for part in dotted.split("."):
            keys = list(section.keys()) if isinstance(section, ml_collections.ConfigDict) else []
            if part not in keys:
                nearest = difflib.get_close_matches(part, keys, n=1)
                hint = f"; did you mean {path}.{nearest[0]}?" if nearest else ""
                raise ValueError(f"{path}.{part}: no such field{hint}")
            section, path = section[part], f"{path}.{part}"


def set_field(c, dotted: str, value) -> None:
    """Sets the field `dotted` ("ppo.lam") of config `c` to `value`."""
    *parents, last = dotted.split(".")
    for part in parents:
        c = c[part]
    c[last] = value


def get_field(c, dotted):
    for part in dotted.split("."):
        c = c[part]
    return c
