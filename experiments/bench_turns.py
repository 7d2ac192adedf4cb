"""Multi-turn rollout: one KV cache carried across turns (`rollout.run_turns`) against prefilling
the prompt and the whole history again at every turn (`rollout.reprefill_turns`), side by side in
one run on the same batch, keys and environment.

`python experiments/bench.py rollout --turns=N [--batch 8] [--prompt 32] [--turn-tokens 24]
[--observation 16] [--shape cpu] [--temperature 0.8] [--seed 0] [--repeats 2] [--slots S]`

Workload: a random policy of `--shape` (experiments/bench_models.py; `cpu`: a 4-layer Llama of
8192 ids) plays N turns against a scripted environment on B random prompts: a turn ends at an
end-of-turn id (one id in 16 is one, so a random model's turns end after about 16 tokens, or at
`--turn-tokens`), the environment answers each turn with `--observation` ids derived from the
action (their first and last ids are fixed markers, as a chat template's are), and row b is done
after turn N - 1 - (b mod 2), so rows end at different turns. The trajectory budget is
N x (turn tokens + observation).

Both drivers are compiled and run once, then timed alternately (`--repeats` times each, best
taken). Printed: the prefill tokens each computes (cache reuse: the prompts once and every
observation once; re-prefilling: every playing row's prompt and history at every turn), their
ratio, the seconds of each and their ratio, and whether their tokens are the same. With `--slots`
also the cache driver over S decode slots (continuous batching across turns): its seconds and
whether its tokens are the same. On a CPU the
numbers are labelled as such: there the sampler's decode steps, which both drivers run alike,
weigh more than on an accelerator.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import rollout

from bench_models import model_settings, random_policy


class ScriptedEnvironment:
    """Observations of `length` ids: a marker, ids taken from the action, a marker; row b is done
    after turn `turns - 1 - b % 2`; reward 1 per turn whose action has an even first id."""

    def __init__(self, turns: int, length: int, vocab_size: int):
        self.turns, self.length, self.vocab_size = turns, length, vocab_size
        self.played = {}

    def __call__(self, rows, actions):
        observations, rewards, done = [], [], []
        for row, action in zip(rows.tolist(), actions):
            turn = self.played.get(row, 0)
            self.played[row] = turn + 1
            finished = turn >= self.turns - 1 - row % 2
            body = (np.resize(action, max(self.length - 2, 0)).astype(np.int64) * 7 + turn) % (self.vocab_size - 20)
            observations.append(None if finished else np.concatenate([[11], body + 20, [12]])[:self.length]
                                .astype(np.int32))
            rewards.append(float(action[0] % 2 == 0))
            done.append(finished)
        return observations, np.asarray(rewards, np.float32), np.asarray(done), np.zeros(len(rows), bool)


def compare_turns(model, params, ids, mask, *, turns: int, turn_tokens: int, observation: int, temperature: float,
                  seed: int, repeats: int, slots: int = 0) -> dict:
    """Both drivers on prompts `ids, mask [B, P]` (and the cache driver over `slots` decode slots
    when nonzero): seconds (best of `repeats` after a first run), prefill and generated tokens, and
    whether the trajectories' tokens agree."""
    vocab = model.config.vocab_size
    settings = dict(row_keys=jax.random.split(jax.random.key(seed), ids.shape[0]), max_turns=turns,
                    max_total_tokens=turns * (turn_tokens + observation), max_turn_tokens=turn_tokens,
                    end_of_turn=tuple(range(20, vocab, 16)), temperature=temperature, pad_id=0)
    drivers = {"cache": rollout.run_turns, "reprefill": rollout.reprefill_turns}
    if slots:
        drivers["slots"] = functools.partial(rollout.run_turns, decode_slots=slots)

    def run(name):
        env = ScriptedEnvironment(turns, observation, vocab)
        start = time.perf_counter()
        out = drivers[name](model, params, ids, mask, step_turns=env, **settings)
        return out, time.perf_counter() - start

    outputs, first, best = {}, {}, {name: float("inf") for name in drivers}
    for name in drivers:
        outputs[name], first[name] = run(name)
    for _ in range(repeats):
        for name in drivers:
            best[name] = min(best[name], run(name)[1])
    cache, reprefill = outputs["cache"], outputs["reprefill"]
    extra = {} if not slots else dict(slots_s=best["slots"], slots_same_tokens=bool(
        np.array_equal(cache.tokens, outputs["slots"].tokens)))
    return dict(**extra, cache_s=best["cache"], reprefill_s=best["reprefill"], cache_first_s=first["cache"],
                reprefill_first_s=first["reprefill"], cache_prefill=cache.prefill_tokens,
                reprefill_prefill=reprefill.prefill_tokens, generated=cache.generated_tokens,
                same_tokens=bool(np.array_equal(cache.tokens, reprefill.tokens)),
                num_turns=cache.num_turns.tolist(), columns=int((cache.kinds != rollout.PAD).sum()))


def run(args) -> None:
    """`bench.py rollout --turns=N`: prints the comparison (args from bench_rollout's parser)."""
    model, params, count = random_policy(model_settings(args.shape, "float32", scan_layers=False))
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.prompt // 2, args.prompt + 1, size=args.batch)
    ids = jnp.asarray(rng.integers(20, model.config.vocab_size, (args.batch, args.prompt)), jnp.int32)
    mask = jnp.asarray(np.arange(args.prompt)[None] >= (args.prompt - lengths)[:, None], jnp.int32)
    device = jax.devices()[0]
    label = " (CPU numbers)" if device.platform == "cpu" else ""
    print(f"model: random {args.shape} ({count / 1e6:.1f}M params, float32), device: {device.device_kind}{label}, "
          f"B={args.batch} prompts of {args.prompt} columns, {args.turns} turns of at most {args.turn_tokens} tokens, "
          f"observations of {args.observation} tokens, T={args.temperature}, seed {args.seed}")
    out = compare_turns(model, params, ids, mask, turns=args.turns, turn_tokens=args.turn_tokens,
                        observation=args.observation, temperature=args.temperature, seed=args.seed,
                        repeats=args.repeats, slots=args.slots)
    print(f"compile + first run: cache {out['cache_first_s']:.1f} s, reprefill {out['reprefill_first_s']:.1f} s")
    print(f"turns per row: {' '.join(str(n) for n in out['num_turns'])}; {out['columns']} trajectory columns, "
          f"{out['generated']} sampled")
    print(f"prefill tokens: cache {out['cache_prefill']}, reprefill {out['reprefill_prefill']}: "
          f"ratio {out['reprefill_prefill'] / out['cache_prefill']:.2f}")
    print(f"cache_s={out['cache_s']:.2f} reprefill_s={out['reprefill_s']:.2f} "
          f"time_ratio={out['reprefill_s'] / out['cache_s']:.2f} "
          f"prefill_ratio={out['reprefill_prefill'] / out['cache_prefill']:.2f} same_tokens={out['same_tokens']}"
          f"{label}")
    if args.slots:
        print(f"slots: cache over {args.slots} decode slots slots_s={out['slots_s']:.2f} "
              f"same_tokens={out['slots_same_tokens']}{label}")
