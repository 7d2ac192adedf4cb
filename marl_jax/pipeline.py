"""SFT -> reward model -> PPO / MA-PPO in one workdir (`Pipeline`), the stages that
`marl_jax.stages.run` runs.

Each stage checkpoints under `<workdir>/checkpoints/<stage>`; a finished stage is reused, an
unfinished one resumes, so running the same command again continues where it stopped. Finished
models are also exported as transformers-loadable directories under `<workdir>/models/`.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from marl_jax import distributed
from marl_jax import envs  # noqa: F401  (registers the multi-turn tasks)
from marl_jax.config_check import validate_config
from marl_jax.credit.hook import ppo_probe
from marl_jax.data.real_tasks import decode_responses
from marl_jax.data.tasks import build_task
from marl_jax.eval.unit_test_reward import attach_unit_test_reward
from marl_jax.models import attention, decode_layout, lora
from marl_jax.train import async_schedule, build, exports, metrics as metrics_lib, preemption
from marl_jax.train import reward, sharding
from marl_jax.train import ppo as ppo_lib
from marl_jax.train.ppo import run_ppo
from marl_jax.train.reward import PAIR_KEYS, run_rm, sample_policy_pairs
from marl_jax.train.sft import run_sft


class Pipeline:
    """The models and data of one workdir; stages run on demand and in order."""

    def __init__(self, config, workdir: str, *, run_earlier_stages: bool = True):
        validate_config(config)
        distributed.initialize(config.distributed)
        sharding.validate_mesh(config.mesh, jax.device_count())
        self.config, self.workdir = config, workdir
        os.makedirs(workdir, exist_ok=True)
        self.mesh = sharding.make_mesh(config.mesh)
        async_schedule.meshes(config, self.mesh)  # a device split that cannot be: one line, now
        for stage in ("sft", "rm", "ppo"):
            sharding.validate_batch(config[stage].batch_size, self.mesh,
                                    f"config.{stage}.batch_size")
        self.writer = metrics_lib.MetricsWriter(workdir, logging=config.get("logging"),
                                                run_config=config.to_dict())
        self.task = build_task(config, workdir)
        if self.task.rl_unit_tests is not None:
            attach_unit_test_reward(config, self.task)
        cfg = build.model_config(config, self.task.tokenizer)
        if len(self.task.tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self.task.tokenizer)} tokens but the model "
                f"(config.model.path={config.model.path!r}) only {cfg.vocab_size}; use the "
                "model's own tokenizer (config.task.tokenizer)")
        if jax.process_index() == 0:
            layout = decode_layout.resolve(cfg, sharding.logical_rules(self.mesh, build.model_dims(cfg)))
            print(f"{attention.describe(cfg)}; sampler layout {layout}; XLA GPU flags "
                  f"{config.model.get('xla_gpu_flags', 'auto')}", flush=True)
        self.policy = build.policy_module(cfg)
        self.reward_model = build.reward_module(cfg)
        self.critic = build.critic_module(cfg)
        self._sft = self._rm = self._initial = self._pretrained_base = None
        self._sampled = False  # the policy's preference pairs are in self.task.rm
        self._sampled_data = None  # the held-out gold pairs, once the sampled data is in
        self.run_earlier_stages = run_earlier_stages
        self.gold = None
        if self.task.info.get("task") == "reviews":
            self._attach_text_gold()

    def _attach_text_gold(self):
        """The review task's gold on decoded text (`marl_jax.eval.review_gold`), for its
        sampled data and its held-out prompts (`TaskData.eval_gold`)."""
        from marl_jax.eval.review_gold import ReviewGold

        t = self.config.task
        self.gold = ReviewGold(min_words=int(t.gold_min_words), max_words=int(t.gold_max_words))
        records = self.task.info["records"]
        self.task.eval_gold = lambda texts, rows=None: self.gold.score(
            records["eval"] if rows is None else [records["eval"][i] for i in rows], texts)

    def initial_params(self):
        """The policy's starting point (the pretrained model), read once."""
        if self._initial is None:
            self._initial = build.initial_policy_params(self.config, self.policy,
                                                        jax.random.key(self.config.seed))
        return self._initial

    def _require(self, name: str, needed_by: str):
        """With `--config.stage=rm` or `ppo`, the earlier stages must have finished already."""
        if self.run_earlier_stages:
            return
        steps = self.config[name].steps
        latest = exports.latest_checkpoint_step(self.workdir, name) if steps else 0
        if steps and (latest or 0) < steps:
            raise FileNotFoundError(
                f"stage {needed_by!r} needs the finished {name!r} stage in {self.workdir} "
                f"(found step {latest or 0} of config.{name}.steps={steps}); run "
                f"--config.stage={name} (or --config.stage=all) with this workdir first")

    def sft(self, needed_by: str = ""):
        if self._sft is None:
            if needed_by:
                self._require("sft", needed_by)
            self._add_sampled_data()
            init = self.initial_params()
            self._initial = None  # held by `init` only, and freed with it
            self._pretrained_base = self._lora_base(init)
            self._sft = run_sft(self.config, self.task, self.policy, init, mesh=self.mesh,
                                writer=self.writer, workdir=self.workdir)
            self._export("sft", self.policy, self._sft, adapter_base=self._pretrained_base)
            if self.policy.config.lora_rank and self.config.model.lora.merge_sft:
                self._sft = lora.merge(self._sft, lora.settings(self.policy.config),
                                       precision=self.policy.config.precision)
        return self._sft

    def _lora_base(self, init):
        """With LoRA, the transformers directory of the pretrained base the SFT adapter applies
        to: `config.model.path` when it is one, else `<workdir>/models/base`, written here from
        `init` (a model built from its config, or read from a GGUF file). None without LoRA."""
        if not self.policy.config.lora_rank:
            return None
        path = self.config.model.path
        if path and os.path.isfile(os.path.join(build.pretrained_path(path), "config.json")):
            return os.path.abspath(build.pretrained_path(path))
        base_dir = exports.export_dir(self.workdir, exports.BASE_EXPORT)
        if not distributed.main_process_value(os.path.isfile(os.path.join(base_dir,
                                                                          "config.json"))):
            base = distributed.global_to_host(lora.frozen_base(init))
            if jax.process_index() == 0:
                tmp = base_dir + ".tmp"
                build.models.save_pretrained(self.policy, base, tmp)
                self.task.tokenizer.save_pretrained(tmp)
                os.replace(tmp, base_dir)
        return os.path.abspath(base_dir)

    def rm(self, needed_by: str = ""):
        if self._rm is None and self.task.rm is None:
            # An environment's task: its rewards are the environment's, no reward model.
            self._rm = (None, {"mean": 0.0, "std": 1.0})
        if self._rm is None:
            if needed_by:
                self._require("rm", needed_by)
            sft_params = self.sft(needed_by="rm")
            # With LoRA only the head and adapters are new (the base is SFT's).
            init_fn = lora.fresh_trainable if self.policy.config.lora_rank \
                else build.models.init_params
            fresh = init_fn(self.reward_model, jax.random.key(self.config.seed + 1))
            init = dict(fresh, backbone=sft_params["backbone"]) \
                if self.config.rm.init_from == "sft" else fresh
            # Pairs sampled from the SFT policy join the data whenever the data is read: to
            # train, or to recompute the reward statistics.
            trains = exports.latest_checkpoint_step(self.workdir, "rm") < self.config.rm.steps
            if trains:
                self._add_policy_pairs(sft_params)
                preemption.safe_point("after sampling the SFT policy's preference pairs")
            self._add_sampled_data()
            # Training only its top layers, the reward model runs the frozen ones once per
            # distinct training sequence (their states reused by every step and the statistics).
            frozen = reward.frozen_trunk_layers(init, int(self.config.rm.num_layers_unfrozen))
            trunk = reward.pair_trunk(self.reward_model, init, self.task.rm, frozen,
                                      batch_size=self.config.rm.batch_size) \
                if trains and frozen and len(self.task.rm["prompt_ids"]) else None
            params = run_rm(self.config, self.task, self.reward_model, init, mesh=self.mesh,
                            writer=self.writer, workdir=self.workdir, trunk=trunk)
            self._write_gold_agreement(params)
            preemption.safe_point("after the reward model's gold agreement")
            # The statistics belong to these params: reused only from an export of the same
            # checkpoint, recomputed (and re-exported) whenever the reward model changed.
            stats = exports.current_export_file(self.workdir, "rm", exports.REWARD_STATS)
            if stats is None:
                self._add_policy_pairs(sft_params)
                if len(self.task.rm["prompt_ids"]) == 0:
                    stats = {"mean": 0.0, "std": 1.0}  # no preference pairs (APPS): nothing to centre
                else:
                    stats = reward.reward_stats(self.reward_model, params, self.task.rm,
                                                batch_size=self.config.rm.batch_size,
                                                trunk=trunk)
            del trunk
            self._export("rm", self.reward_model, params, extra={exports.REWARD_STATS: stats},
                         adapter_base=self._sft_base())
            self._rm = (params, stats)
        return self._rm

    def _add_policy_pairs(self, sft_params) -> None:
        """Adds to the task's preference pairs pairs sampled from the SFT policy with PPO's
        sampler and labelled by the task's annotator (once, for tasks that have them): the
        reward model then also learns the responses PPO starts from."""
        if self.task.policy_pair_prompts is None or self._sampled:
            return
        p = self.config.ppo
        static = ppo_lib.static_from_config(self.config, self.task.tokenizer)
        sampled = sample_policy_pairs(
            self._sft_policy(), sft_params, self.task.policy_pair_prompts, self.task.label_pairs,
            key=jax.random.fold_in(jax.random.key(self.config.seed), 11),
            sampler=dict(max_new_tokens=p.response_length, temperature=static.temperature,
                         top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id,
                         pad_id=static.pad_id),
            batch_size=self.config.rm.batch_size)
        self.task.rm = {k: np.concatenate([v, sampled[k]]) for k, v in self.task.rm.items()}
        self._sampled = True

    def _add_sampled_data(self) -> None:
        """For a task that ships prompts only: the SFT set (best of k) and the preference pairs
        from the initial model's samples, scored by the gold (`marl_jax.train.sampled_data`);
        sampled once per workdir."""
        if self.task.sampled_prompts is None or self._sampled_data is not None:
            return
        from marl_jax.train import sampled_data

        t, p = self.config.task, self.config.ppo
        static = ppo_lib.static_from_config(self.config, self.task.tokenizer)
        sampler = dict(max_new_tokens=int(p.response_length), temperature=static.temperature,
                       top_k=static.top_k, top_p=static.top_p, eos_id=static.eos_id,
                       pad_id=static.pad_id)
        k = int(t.samples_per_prompt)
        records = self.task.info["records"]
        out = {}
        for i, (part, prompts) in enumerate(self.task.sampled_prompts.items()):
            settings = dict(model=sampled_data.model_identity(self.config.model.path), dtype=str(self.config.model.dtype),
                            seed=int(self.config.seed), data_seed=int(t.data_seed),
                            num_prompts=len(prompts["ids"]), samples_per_prompt=k,
                            prompts=[r["prompt"] for r in records[part][:3]],
                            **{key: (float(v) if isinstance(v, float) else v)
                               for key, v in sampler.items()})
            loaded = sampled_data.load_samples(self.workdir, part, settings)
            if loaded is None:
                # The initial model is a base: with LoRA, the adapters are off.
                ids, mask = sampled_data.sample_responses(
                    lora.adapters_off(self.policy), self.initial_params(), prompts, num_samples=k,
                    key=jax.random.fold_in(jax.random.key(self.config.seed), 100 + i),
                    sampler=sampler, batch_size=int(t.sample_batch_size), desc=f"sample {part}")
                texts = decode_responses(self.task.tokenizer, ids.reshape(-1, ids.shape[-1]),
                                         mask.reshape(-1, ids.shape[-1]))
                gold = self.gold.score([r for r in records[part] for _ in range(k)],
                                       texts).reshape(-1, k)
                sampled_data.save_samples(self.workdir, part, settings, ids, mask, gold, texts)
            else:
                ids, mask, gold = loaded
            preemption.safe_point(f"after the sampled {part} data")
            out[part] = (prompts, ids, mask, gold)
        rng = np.random.default_rng(int(t.data_seed) + 1)
        self.task.sft = sampled_data.best_of_k(*out["sft"])
        pairs = sampled_data.labelled_pairs(*out["rm"], rng=rng,
                                            temperature=float(t.annotator_temperature),
                                            pairs_per_prompt=int(t.pairs_per_prompt))
        self.task.rm = {k: pairs[k] for k in PAIR_KEYS}
        held_out = sampled_data.labelled_pairs(*out["rm_eval"], rng=rng, temperature=0.0)
        self._sampled_data = dict(
            held_out_pairs={k: held_out[k] for k in PAIR_KEYS},
            stats={"sampled/gold_mean": float(np.mean(out["sft"][3])),
                   "sampled/best_of_k_gold": float(np.mean(np.max(out["sft"][3], axis=1))),
                   "sampled/pairs": len(pairs["gold_agrees"]),
                   "sampled/annotator_agreement": float(np.mean(pairs["gold_agrees"]))})

    def _write_gold_agreement(self, rm_params) -> None:
        """The `rm` row with `rm/gold_agreement`: the fraction of the held-out pairs (labelled
        by the gold alone) whose gold-preferred response the reward model scores higher."""
        if self._sampled_data is None:
            return
        from marl_jax.train.reward import pair_agreement

        step = int(self.config.rm.steps)
        # Process 0 reads metrics.jsonl; its answer decides for all (the scoring is collective).
        if distributed.main_process_value(any(
                r.get("stage") == "rm" and "rm/gold_agreement" in r and r.get("step") == step
                for r in metrics_lib.read_metrics(self.workdir))):
            return
        pairs = self._sampled_data["held_out_pairs"]
        agreement = pair_agreement(self.reward_model, rm_params, pairs,
                                   batch_size=self.config.rm.batch_size)
        self.writer.write(dict(stage="rm", step=step, **{
            "rm/gold_agreement": agreement, "rm/gold_pairs": len(pairs["prompt_ids"])},
            **self._sampled_data["stats"]))

    def ppo(self):
        rm_params, stats = self.rm(needed_by="ppo")
        sft_params = self.sft(needed_by="ppo")
        state = run_ppo(self.config, self.task, self.policy, self.critic, self.reward_model,
                        sft_params, rm_params, stats, mesh=self.mesh, writer=self.writer,
                        workdir=self.workdir,
                        make_probe=ppo_probe(self.config, self.task, self.workdir))
        if not self.policy.config.lora_rank:
            self._export("policy", self.policy, state.actor_params)
            return state
        self._export("policy", self.policy, lora.attach(lora.frozen_base(sft_params),
                                                         state.actor_params),
                     adapter_base=self._sft_base())
        return state

    def _sft_policy(self):
        """The module that applies the SFT params: with LoRA and a merged SFT adapter the policy
        with its adapters off, else the policy."""
        if self.policy.config.lora_rank and self.config.model.lora.merge_sft:
            return lora.adapters_off(self.policy)
        return self.policy

    def _sft_base(self):
        """The directory of the base the reward model's and the actor's adapters apply to: the
        SFT model when SFT merged its adapter into it, else the pretrained base."""
        if not self.policy.config.lora_rank:
            return None
        if self.config.model.lora.merge_sft:
            return os.path.abspath(exports.export_dir(self.workdir, "sft"))
        return self._pretrained_base

    def _export(self, name, module, params, extra=None, adapter_base=None):
        exports.export_model(self.workdir, name, module, params, self.task.tokenizer, extra,
                             adapter_base)

    def close(self):
        self.writer.close()
