"""Asynchronous PPO beside the synchronous loop, on the setup of `bench.py ppo` (four models of
one shape, random weights, every response its whole budget, token PPO).

`python experiments/bench.py ppo --async --shape=w1 [--small] [--repeats N] [--dtype auto]`

Timed, the same iteration as
  sync   the synchronous step's four phase programs on every device, each waited on
         (`ppo.phase_timing`, what `bench.py ppo` times);
  k=1, k=2  the asynchronous loop (`train/async_step.py`, `rollout.max_staleness=k`, each
         response in k chunks): with two devices or more the sampler on the second half of
         them and the trainer on the first (`rollout.sampler_devices`), a thread waiting for
         the sampler's half while the trainer's phases are waited on one by one, the new
         weights copied to the sampler after each update; on one device both halves take
         turns on it (nothing overlaps there).
Printed per loop, as medians over the timed iterations: the iteration's seconds, the rollout
(the sampler's) and the update (the trainer's: score, advantages, update) seconds, their
overlap (rollout + update) / iteration (1: one after the other; 2: entirely at once; with the
95% interval of its median) and the weight copy; then one JSON line of every number. On a CPU, two host devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=2`. A shape other than w1: one line, exit 2.
"""
import json
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

import bench_ppo
from bench_timing import median_ratio

STALENESS = (1, 2)
TRAINER_PHASES = ("score", "advantages", "update")


class AsyncIteration:
    """The asynchronous loop's programs and state for `setup` at staleness k, on `trainer` and
    `sampler` devices (the same list: one set)."""

    def __init__(self, setup, k: int, trainer, sampler):
        from marl_jax import models
        from marl_jax.train import async_schedule, async_step, build, programs, sharding
        from marl_jax.train import ppo as ppo_lib

        config = bench_ppo.config_of(setup)
        config.rollout.max_staleness = k
        policy, critic, reward = bench_ppo.modules(config)
        eos = policy.config.eos_token_id[0]
        tokens = types.SimpleNamespace(eos_token_id=eos, pad_token_id=policy.config.pad_token_id)
        static = ppo_lib.static_from_config(config, tokens)
        mods = ppo_lib.make_models(config, policy, critic, reward)
        self.mesh = mesh = sharding.make_mesh(config.mesh, trainer)
        sampler_mesh = None if sampler == trainer else sharding.make_mesh(config.mesh, sampler)
        self.rules = sharding.logical_rules(mesh, build.model_dims(policy.config))
        init = lambda module, seed: jax.jit(  # noqa: E731
            lambda key: models.init_params(module, key))(jax.random.key(seed))
        actor = bench_ppo.without_eos(init(policy, 0), policy.config, eos)
        rm_params = init(reward, 1)
        critic_params = ppo_lib.initial_critic_params(config, critic, actor, rm_params,
                                                      jax.random.key(2))
        state_sh = ppo_lib.state_shardings(mods, mesh, actor, critic_params)
        frozen_sh = programs.frozen_shardings(mods, mesh, state_sh, rm_params)
        copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=state_sh)
        state = copy(jax.device_put(ppo_lib.initial_state(config, mods, actor, critic_params, 0),
                                    state_sh))
        self.frozen = jax.device_put(ppo_lib.frozen_models(
            mods, actor, rm_params, {"mean": 0.0, "std": 1.0}), frozen_sh)
        self.hparams = jax.device_put(ppo_lib.hparams_from_config(config.ppo),
                                      sharding.replicated(mesh))
        rng = np.random.default_rng(0)
        rows = 4 * static.prompts_per_step
        ids = rng.integers(3, policy.config.vocab_size, (rows, setup.prompt)).astype(np.int32)
        task = types.SimpleNamespace(rl=dict(ids=ids, mask=np.ones_like(ids)))
        with sharding.mesh_context(mesh, self.rules):
            self.loop = async_step.AsyncStep(
                config, task, static, mods, state_sh, frozen_sh, mesh,
                async_schedule.Schedule.from_config(config), timed=True,
                sampler_mesh=sampler_mesh)
            self.state = self.loop.initial_state(state, self.frozen)
        self.step = 0

    def run(self) -> dict:
        """The timing fields of the next iteration (`timing/*`)."""
        from marl_jax.train import sharding

        with sharding.mesh_context(self.mesh, self.rules):
            self.state, metrics = self.loop(self.state, self.frozen, self.hparams, self.step)
        self.step += 1
        return {k: float(v) for k, v in metrics.items() if k.startswith("timing/")}


def _sync_timing(iteration) -> dict:
    seconds, metrics = iteration.run("phases", "ppo")
    return {"timing/iteration_s": seconds, **{f"timing/{p}_s": float(metrics[f"timing/{p}_s"])
                                              for p in bench_ppo.PHASES}}


def summary(rows: list[dict]) -> dict:
    """Medians of a loop's timed iterations: iteration, rollout, update (the trainer's three
    phases) and weight-copy seconds, and the overlap."""
    median = lambda xs: float(np.median(xs))  # noqa: E731
    rollout = np.array([r["timing/rollout_s"] for r in rows])
    update = np.array([sum(r[f"timing/{p}_s"] for p in TRAINER_PHASES) for r in rows])
    iteration = np.array([r["timing/iteration_s"] for r in rows])
    overlap = median_ratio(rollout + update, iteration)
    return dict(iteration_s=median(iteration), rollout_s=median(rollout),
                update_s=median(update),
                weight_copy_s=median([r.get("timing/weight_copy_s", 0.0) for r in rows]),
                overlap=overlap["median"], overlap_ci=overlap["ci"], iterations=len(rows))


def measure(setup, repeats: int, staleness=STALENESS) -> dict:
    """Every number the bench prints (also the device suite's `ppo_async_w1` row), for the
    asynchronous loop at each k of `staleness`."""
    from marl_jax.train import sharding

    devices = jax.devices()
    half = len(devices) // 2
    trainer, sampler = (devices[:half], devices[half:]) if half else (devices, devices)
    out = dict(shape=setup.shape, small=setup.small, model=bench_ppo.describe(setup),
               devices=len(devices), device_kind=devices[0].device_kind,
               trainer_devices=len(trainer), sampler_devices=len(sampler) if half else 0,
               repeats=repeats, staleness=list(staleness))
    sync = bench_ppo.Iteration(setup, sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}))
    _sync_timing(sync)  # compiles
    out["sync"] = summary([_sync_timing(sync) for _ in range(repeats)])
    del sync
    for k in staleness:
        loop = AsyncIteration(setup, k, trainer, sampler)
        loop.run()  # compiles
        out[f"k{k}"] = summary([loop.run() for _ in range(repeats)])
        del loop
    out["text"] = report(out)
    return out


def report(r: dict) -> str:
    where = (f"sampler on {r['sampler_devices']} device(s), trainer on {r['trainer_devices']}"
             if r["sampler_devices"] else "one device: the halves take turns, nothing overlaps")
    lines = [f"{r['shape']}: {r['model']}; {r['devices']} x {r['device_kind']}; asynchronous: "
             f"{where}; medians of {r['repeats']} iterations"]
    for name, label in (("sync", "synchronous (every device, phase by phase)"),
                        *((f"k{k}", f"k = {k}") for k in r["staleness"])):
        s = r[name]
        ci = "" if s["overlap_ci"] is None else " [{:.2f}, {:.2f}]".format(*s["overlap_ci"])
        lines.append(f"{label}: iteration {s['iteration_s']:.3f} s, rollout {s['rollout_s']:.3f} s, "
                     f"update {s['update_s']:.3f} s, overlap {s['overlap']:.2f}{ci}"
                     + (f", weight copy {s['weight_copy_s'] * 1e3:.1f} ms" if name != "sync" else "")
                     + (f"; {r['sync']['iteration_s'] / s['iteration_s']:.2f}x the synchronous "
                        "iteration's speed" if name != "sync" else ""))
    return "\n".join(lines)


def main(argv) -> None:
    """`bench.py ppo --async [flags]`: bench_ppo's flags; a refused setting is one line, exit
    status 2."""
    try:
        run(bench_ppo.arguments(argv))
    except bench_ppo.Refused as error:
        print(f"bench.py ppo --async: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args) -> None:
    """The benchmark on bench_ppo's parsed flags `args`."""
    if args.shape != "w1":
        raise bench_ppo.Refused(f"--shape={args.shape!r} with --async: the asynchronous loop "
                                "is timed on w1 (four SmolLM2-135M-shaped models, or --small)")
    setup = bench_ppo.setup_of(args.shape, args.small, args.dtype)
    repeats = args.repeats or (10 if args.small else 3)
    if repeats < 1:
        raise bench_ppo.Refused(f"--repeats={repeats} must be >= 1")
    from marl_jax.train import compile_cache

    compile_cache.use_run_cache()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
          f"({jax.default_backend()})", flush=True)
    started = time.perf_counter()
    result = measure(setup, repeats)
    result["seconds"] = time.perf_counter() - started
    print(result.pop("text"))
    print(json.dumps(result))
