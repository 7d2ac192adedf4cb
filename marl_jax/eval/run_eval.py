"""Stage `eval`: the final PPO policy of a workdir against its SFT policy, on held-out prompts.

`evaluate_workdir(pipeline)` loads `<workdir>/models/sft` and `<workdir>/models/policy` (the SFT
model falls back to its finished checkpoint), samples one response per held-out prompt from each
with the PPO sampler (`config.ppo.temperature`, `top_k`, `top_p`, `response_length`) and writes
`<workdir>/eval/`. Every model is evaluated as a plain one (a LoRA run's exports hold its
adapters merged). The policy draws with the PPO stage's evaluation key: with
`config.eval.batch_size` covering the held-out prompts its KL, normalised RM score, length and
gold are those of PPO's last evaluation row.

- `summary.json`: per model the RM-score statistics (`eval.scores.score_summary`: mean, std,
  min, max, histogram) of the reward model in `<workdir>/models/rm`, the mean score normalised
  by the statistics PPO used, the KL to the SFT model (nats per response, sampling-temperature
  logprobs as in training), the response length, the gold score (synthetic task); the pairwise
  win rate of the policy against SFT under `config.eval.judge` (ties count half); for APPS the
  unbiased pass@k (`config.eval.pass_at_k`) from `config.eval.num_samples` programs per problem
  and the mean fraction of unit tests passed, with the sandbox's self-report (`isolation`:
  which jail ran the programs, its namespaces, seccomp, ...);
- `samples.jsonl`: per sample the prompt, the response (text and token ids), its scores, and the
  judge's preference for the policy;
- `rm_scores.png`: the two RM-score histograms.

It also logs one metrics row per model, `{"stage": "eval_final", "arm": "sft" | "policy",
"step": config.ppo.steps, ...}`. Judges (`config.eval.judge`): `rm` compares the two RM scores of
each prompt, `gold` the synthetic task's gold scores, `openai` asks an OpenAI-compatible chat
endpoint (`config.eval.base_url` / `model` / `api_key`, else $MARL_JUDGE_BASE_URL /
$MARL_JUDGE_MODEL / $OPENAI_API_KEY) with the paper's TL;DR or HH template and a random A/B order
per pair, on the first `config.eval.judge_max_samples` prompts; `none` skips the comparison.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import IO, Any, Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import models, rollout
from marl_jax.data import batches
from marl_jax.data.real_tasks import decode_responses, extract_code
from marl_jax.eval import judges, scores
from marl_jax.eval.unit_test_reward import unit_test_options
from marl_jax.models import lora
from marl_jax.train import build, exports, phases, ppo, preemption, sharding
from marl_jax.train.metrics import summary_table

JUDGES = ("rm", "gold", "openai", "none")
MODELS = ("sft", "policy")
EVAL_DIR = "eval"
# Judge template of each task for the openai judge (see marl_jax.eval.judges.TEMPLATES).
TEMPLATE_BY_TASK = {"synthetic": "tldr", "tldr": "tldr", "hh_rlhf": "hh", "webgpt": "hh"}


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The PPO sampler's settings (hashable: a static argument of the jitted rollout)."""

    response_length: int
    temperature: float
    top_k: int
    top_p: float
    eos_id: Any
    pad_id: int
    decode_slots: int = 0  # config.ppo.decode_slots: continuous batching over that many slots


def evaluate_workdir(pipeline) -> Optional[dict]:
    """Runs the evaluation of `pipeline.workdir`; returns the summary (None off process 0)."""
    config, task = pipeline.config, pipeline.task
    validate_eval_config(config, task, pipeline.mesh)
    e = config.eval
    params = {name: trained_policy(pipeline, name) for name in MODELS}
    rm_params, reward_stats = trained_reward_model(pipeline) if has_reward_model(config, task) \
        else (None, None)
    build.release_pretrained()

    apps = config.task.name == "apps"
    num_prompts = len(task.eval["ids"]) if not e.max_prompts else min(e.max_prompts,
                                                                      len(task.eval["ids"]))
    samples_per_prompt = int(e.num_samples) if apps else 1
    prompt_index = np.repeat(np.arange(num_prompts), samples_per_prompt)
    rollouts = Rollout(pipeline, rm_params)
    results = {}
    for name in MODELS:
        results[name] = rollouts(params[name], params["sft"], prompt_index,
                                 model_key(config.seed, name), name=name)
    if jax.process_index() != 0:
        return None

    tokenizer = task.tokenizer
    texts = {name: [t.strip() for t in decode_responses(tokenizer, r["response_ids"],
                                                          r["response_mask"])]
             for name, r in results.items()}
    prompts = [prompt_text(task, i) for i in prompt_index]
    summary = dict(task=config.task.name, workdir=os.path.abspath(pipeline.workdir),
                   num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                   sampler=dataclasses.asdict(rollouts.sampler), models={})
    for name, r in results.items():
        summary["models"][name] = model_summary(r, reward_stats, e.histogram_bins)
    out_dir = os.path.join(pipeline.workdir, EVAL_DIR)
    os.makedirs(out_dir, exist_ok=True)
    if rm_params is not None:
        summary["plots"] = {"rm_scores": os.path.join(EVAL_DIR, "rm_scores.png")}
        scores.plot_score_histogram(
            {name: r["rm_score"] for name, r in results.items()},
            os.path.join(out_dir, "rm_scores.png"), bins=int(e.histogram_bins),
            title=f"{config.task.name}: RM scores of held-out responses", xlabel="RM score")

    preferences = np.full(len(prompt_index), np.nan)
    if e.judge != "none":
        judged, summary["win_rate"] = judge_pairs(config, results, prompts, texts)
        preferences[:len(judged)] = judged
    passed = None
    if apps:
        passed, summary["apps"] = apps_results(config, task, prompt_index, texts,
                                               samples_per_prompt)
    write_samples(os.path.join(out_dir, "samples.jsonl"), prompt_index, prompts, texts, results,
                  preferences, passed)
    with _replacing(os.path.join(out_dir, "summary.json")) as f:
        json.dump(summary, f, indent=2)
    log_rows(pipeline.writer, config, summary)
    return summary


def model_key(seed: int, name: str) -> jax.Array:
    """The sampling key of model `name`: the final policy draws with the PPO stage's evaluation
    key, so with one batch of every held-out prompt its samples are those of PPO's last
    evaluation."""
    if name == "policy":
        return ppo.eval_key(seed)
    return jax.random.fold_in(jax.random.key(seed), 7919)


# ---- configuration -------------------------------------------------------------------------
def has_reward_model(config, task) -> bool:
    """Whether the workdir has a trained reward model (APPS and `rm.steps=0` runs do not)."""
    return config.rm.steps > 0 and len(task.rm["prompt_ids"]) > 0


def validate_eval_config(config, task, mesh) -> None:
    """Raises ValueError naming the first bad `config.eval` field, before anything compiles."""
    e = config.eval

    def check(cond, field, msg):
        if not cond:
            raise ValueError(f"config.eval.{field}={e[field]!r}: {msg}")

    check(e.judge in JUDGES, "judge", f"must be one of {JUDGES}")
    check(e.judge != "gold" or task.gold_fn is not None, "judge",
          f"the task {config.task.name!r} has no gold reward (only the synthetic task has one)")
    check(e.judge != "rm" or has_reward_model(config, task), "judge",
          "this workdir has no trained reward model (config.rm.steps=0 or no preference pairs); "
          "use 'none' or 'openai'")
    if e.judge == "openai":
        check(bool(e.model or os.environ.get("MARL_JUDGE_MODEL")), "model",
              "the openai judge needs a model name (or $MARL_JUDGE_MODEL)")
        check(bool(e.judge_template) or config.task.name in TEMPLATE_BY_TASK, "judge_template",
              f"no judge template for task {config.task.name!r}; give 'tldr', 'hh' or a template "
              "with {prompt}, {response_a} and {response_b}")
    for field in ("max_prompts", "batch_size", "judge_max_samples"):
        check(isinstance(e[field], int) and e[field] >= 0, field, "must be an int >= 0")
    check(isinstance(e.num_samples, int) and e.num_samples >= 1, "num_samples", "must be >= 1")
    check(isinstance(e.histogram_bins, int) and e.histogram_bins >= 1, "histogram_bins",
          "must be >= 1")
    check(e.judge_workers >= 1, "judge_workers", "must be >= 1")
    check(e.judge_timeout_s > 0, "judge_timeout_s", "must be > 0")
    if config.task.name == "apps":
        check(all(isinstance(k, int) and 1 <= k <= e.num_samples for k in e.pass_at_k),
              "pass_at_k", f"every k must be in [1, config.eval.num_samples={e.num_samples}]")
    sharding.validate_batch(eval_batch_size(config), mesh, "config.eval.batch_size")


def eval_batch_size(config) -> int:
    return int(config.eval.batch_size or config.ppo.batch_size)


# ---- models --------------------------------------------------------------------------------
def _exported(pipeline, name: str) -> str:
    return exports.export_dir(pipeline.workdir, name)


def _load_export(pipeline, name: str, module, head: str):
    """Params of `<workdir>/models/<name>`, checked against the pipeline's `module` with its
    adapters off: an export is a plain model (LoRA adapters merged into it)."""
    path = _exported(pipeline, name)
    _, params = models.load_pretrained(path, dtype=jnp.dtype(pipeline.config.model.param_dtype),
                                       head=head, scan_layers=module.config.scan_layers)
    plain = lora.adapters_off(module)
    expected = jax.eval_shape(lambda: models.init_params(plain, jax.random.key(0)))
    if _signature(params) != _signature(expected):
        raise ValueError(f"{path} does not match the model of this config "
                         f"(config.model.path={pipeline.config.model.path!r}); evaluate a workdir "
                         "with the config it was trained with")
    return params


def _signature(tree):
    return jax.tree.structure(tree), [(tuple(x.shape), jnp.dtype(x.dtype))
                                      for x in jax.tree.leaves(tree)]


def _merged(module, params):
    """`params` as a plain model: LoRA adapters merged into their kernels (as the exports are)."""
    settings = lora.settings(module.config)
    if not (settings and lora.has_adapters(params)):
        return params
    return lora.merge(params, settings, precision=module.config.precision)


def trained_policy(pipeline, name: str):
    """The `sft` or final PPO (`policy`) params of the workdir as a plain model, applied by
    `lora.adapters_off(pipeline.policy)` (an export older than its stage's last checkpoint is
    refused)."""
    if os.path.isdir(_exported(pipeline, name)):
        exports.check_export_current(pipeline.workdir, name)
        return _load_export(pipeline, name, pipeline.policy, "lm")
    if name == "sft":
        return _merged(pipeline.policy, pipeline.sft(needed_by="eval"))
    raise FileNotFoundError(
        f"{_exported(pipeline, name)} does not exist: the PPO stage has not finished in "
        f"{pipeline.workdir}; run --config.stage=ppo (or all) with this workdir first")


def trained_reward_model(pipeline):
    """(params, score statistics) of the workdir's reward model, its params a plain model
    applied by `lora.adapters_off(pipeline.reward_model)`."""
    path = _exported(pipeline, "rm")
    stats_file = os.path.join(path, exports.REWARD_STATS)
    if os.path.isdir(path) and os.path.isfile(stats_file):
        exports.check_export_current(pipeline.workdir, "rm")
        with open(stats_file) as f:
            return _load_export(pipeline, "rm", pipeline.reward_model, "scalar"), json.load(f)
    params, stats = pipeline.rm(needed_by="eval")
    return _merged(pipeline.reward_model, params), stats


# ---- sampling and scoring ------------------------------------------------------------------
def rollout_batch(sampler: Sampler, policy, reward_model, gold_fn, params, ref_params, rm_params,
                  prompt_ids, prompt_mask, documents, key_data) -> dict:
    """Samples responses to `prompt_ids [B, P]` with the key of raw `key_data` and scores them.
    Jittable.

    Returns response_ids / response_mask `[B, R]`, and `[B]`: kl (to `ref_params`, summed over
    the response), length, rm_score (raw reward-model output; absent without `rm_params`), gold
    (absent without `gold_fn`).
    """
    sample = rollout.generate(
        policy, params, prompt_ids, prompt_mask, key=jax.random.wrap_key_data(key_data),
        max_new_tokens=sampler.response_length,
        temperature=sampler.temperature, top_k=sampler.top_k, top_p=sampler.top_p,
        eos_id=sampler.eos_id, pad_id=sampler.pad_id, decode_slots=sampler.decode_slots)
    ids, mask = sample.tokens, sample.mask.astype(jnp.int32)
    args = (prompt_ids, prompt_mask, ids, mask)
    logp, _ = phases.score.token_logprobs(policy, params, *args, sampler.temperature)
    ref, _ = phases.score.token_logprobs(policy, ref_params, *args, sampler.temperature)
    out = {"response_ids": ids, "response_mask": mask, "kl": ((logp - ref) * mask).sum(axis=1),
           "length": mask.sum(axis=1).astype(jnp.float32)}
    if rm_params is not None:
        out["rm_score"] = phases.score.sequence_scores(reward_model, rm_params, *args)
    if gold_fn is not None:
        out["gold"] = gold_fn(documents, ids, mask)
    return out


class Rollout:
    """`rollout(params, ref_params, prompt_index [N], key, name=model) -> dict of numpy [N, ...]`:
    samples one response per entry of `prompt_index` (indices into `task.eval`), in batches of
    `eval_batch_size(config)` sharded over the pipeline's mesh. A preemption notice stops the
    run between two batches (`preemption.safe_point`, naming the model `name`)."""

    def __init__(self, pipeline, rm_params):
        config, task = pipeline.config, pipeline.task
        p, tokenizer = config.ppo, task.tokenizer
        eos = tokenizer.eos_token_id
        self.sampler = Sampler(
            response_length=int(p.response_length), temperature=float(p.temperature),
            top_k=int(p.top_k), top_p=float(p.top_p), eos_id=eos,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
            decode_slots=int(p.get("decode_slots", 0)))
        self.pipeline, self.task = pipeline, task
        self.batch_size = eval_batch_size(config)
        mesh = pipeline.mesh
        self.rules = sharding.logical_rules(mesh, build.model_dims(pipeline.policy.config))
        # Every model evaluated is a plain one (LoRA adapters merged, as in the exports).
        self.policy = lora.adapters_off(pipeline.policy)
        reward_model = lora.adapters_off(pipeline.reward_model)
        self.fn = jax.jit(functools.partial(rollout_batch, self.sampler, self.policy,
                                            reward_model, task.gold_fn))
        self.rm_params = None if rm_params is None else self._place(reward_model, rm_params)

    def _place(self, module, params):
        mesh = self.pipeline.mesh
        return jax.device_put(params, build.param_shardings(module, mesh, build.abstract(params)))

    def __call__(self, params, ref_params, prompt_index, key, *, name: str) -> dict:
        mesh = self.pipeline.mesh
        params, ref_params = (self._place(self.policy, x) for x in (params, ref_params))
        b = self.batch_size
        padded = np.concatenate([prompt_index, np.full(-len(prompt_index) % b,
                                                       prompt_index[-1])])
        outputs, batch_sh = [], sharding.batch_sharding(mesh)
        num_batches = len(padded) // b
        with sharding.mesh_context(mesh, self.rules):
            for step, start in enumerate(range(0, len(padded), b)):
                rows = batches.process_rows(padded[start:start + b], batch_sh)
                batch = sharding.shard_batch(
                    {k: v[rows] for k, v in self.task.eval.items()}, mesh)
                # The key enters as replicated raw data: on several processes a jitted
                # computation takes global arrays only.
                # The first batch draws with the key itself, as PPO's evaluation does.
                batch_key = jax.random.fold_in(key, step) if step else key
                key_data = jax.device_put(jax.random.key_data(batch_key),
                                          sharding.replicated(mesh))
                out = self.fn(params, ref_params, self.rm_params, batch["ids"], batch["mask"],
                              batch.get("documents"), key_data)
                outputs.append(jax.tree.map(_host, out))
                preemption.safe_point(f"eval of {name}, held-out batch {step + 1} of "
                                      f"{num_batches}")
        return {k: np.concatenate([o[k] for o in outputs])[:len(prompt_index)]
                for k in outputs[0]}


def _host(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ---- summaries -----------------------------------------------------------------------------
def prompt_text(task, index: int) -> str:
    """The held-out prompt as a judge should see it: the dataset's prompt before any chat
    template, or the decoded prompt of the synthetic task."""
    records = task.info.get("eval_records")
    if records:
        return records[index].get("raw_prompt", records[index]["prompt"])
    ids, mask = task.eval["ids"][index], task.eval["mask"][index]
    return task.tokenizer.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=True)


def model_summary(result: dict, reward_stats: Optional[dict], bins: int) -> dict:
    out = {"length_mean": float(np.mean(result["length"])),
           "kl": scores.score_summary(result["kl"], bins=bins)}
    if "rm_score" in result:
        out["rm_score"] = scores.score_summary(result["rm_score"], bins=bins)
        out["rm_score_normalized_mean"] = float(np.mean(
            (result["rm_score"] - reward_stats["mean"]) / reward_stats["std"]))
    if "gold" in result:
        out["gold"] = scores.score_summary(result["gold"], bins=bins)
    return out


class ScoreDifferenceJudge:
    """The judge protocol of `marl_jax.eval.judges` over per-pair scores computed on the sampled
    tokens: A (`ours[i]`) wins when its score is higher than `theirs[i]` by more than
    `tie_margin`; the texts passed in only fix the number of pairs."""

    def __init__(self, ours, theirs, tie_margin: float = 0.0):
        self.ours, self.theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        self.tie_margin = tie_margin

    def __call__(self, prompts, responses_a, responses_b) -> np.ndarray:
        n = len(prompts)
        if n != len(self.ours):
            raise ValueError(f"{n} pairs given for {len(self.ours)} scores")
        diff = self.ours - self.theirs
        return np.where(np.abs(diff) <= self.tie_margin, 0.5, np.where(diff > 0, 1.0, 0.0))


def make_judge(config, results: dict, n: int) -> Callable:
    """The judge of `config.eval.judge` for the first `n` pairs (policy is side A)."""
    e = config.eval
    if e.judge in ("rm", "gold"):
        key = "rm_score" if e.judge == "rm" else "gold"
        return ScoreDifferenceJudge(results["policy"][key][:n], results["sft"][key][:n])
    return judges.OpenAIJudge(
        base_url=e.base_url or None, model=e.model or None, api_key=e.api_key or None,
        template=e.judge_template or TEMPLATE_BY_TASK[config.task.name], seed=config.seed,
        max_workers=int(e.judge_workers), timeout_s=float(e.judge_timeout_s))


def judge_pairs(config, results, prompts, texts):
    """(preferences for the policy `[n]`, win-rate dict) on the first n prompts."""
    e = config.eval
    n = len(prompts)
    if e.judge == "openai" and e.judge_max_samples:
        n = min(n, int(e.judge_max_samples))
    judge = make_judge(config, results, n)
    ours, theirs = texts["policy"][:n], texts["sft"][:n]
    preferences = np.asarray(judge(prompts[:n], ours, theirs), np.float64)
    outcome = judges.win_rate(lambda *_: preferences, prompts[:n], ours, theirs)
    outcome.update(getattr(judge, "last_stats", None) or {})
    outcome["judge"] = e.judge
    if e.judge == "openai":
        outcome["judge_model"] = judge.model
    return preferences, outcome


def apps_results(config, task, prompt_index, texts, samples_per_prompt):
    """(per-sample fraction of tests passed per model, APPS summary with pass@k per model and
    the `isolation` self-report of the sandbox the programs ran in)."""
    from marl_jax.eval import apps, sandbox

    options = unit_test_options(config)
    records = task.info["eval_records"]
    tests = [records[i]["input_output"] for i in prompt_index]
    passed, summary = {}, {"num_problems": len(prompt_index) // samples_per_prompt,
                           "samples_per_problem": samples_per_prompt,
                           "isolation": sandbox.describe_isolation(
                               options["limits"], options["sandbox"],
                               options["allow_unfiltered_jail"])}
    for name, model_texts in texts.items():
        runs = apps.run_solutions([extract_code(t) for t in model_texts], tests, **options)
        per_problem = [runs[i:i + samples_per_prompt]
                       for i in range(0, len(runs), samples_per_prompt)]
        passed[name] = [apps.unit_test_reward(r) for r in runs]
        summary[name] = {f"pass@{k}": apps.apps_pass_at_k(per_problem, int(k))
                         for k in config.eval.pass_at_k}
        summary[name]["unit_test_reward_mean"] = float(np.mean(passed[name]))
    return passed, summary


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[IO[str]]:
    """A text file written beside `path` and renamed into it once whole: a run stopped while
    writing (a preemption notice stops one process at once) leaves the previous file or none."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            yield f
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_samples(path, prompt_index, prompts, texts, results, preferences, passed):
    with _replacing(path) as f:
        for j, i in enumerate(prompt_index):
            row = {"prompt_index": int(i), "prompt": prompts[j],
                   "policy_preference": None if np.isnan(preferences[j]) else float(preferences[j])}
            for name, r in results.items():
                length = int(r["response_mask"][j].sum())
                row[name] = {"response": texts[name][j],
                             "response_ids": r["response_ids"][j, :length].tolist()}
                for key in ("rm_score", "kl", "gold"):
                    if key in r:
                        row[name][key] = float(r[key][j])
                if passed is not None:
                    row[name]["unit_tests_passed"] = passed[name][j]
            f.write(json.dumps(row) + "\n")


def log_rows(writer, config, summary):
    """One `eval_final` metrics row per model, and a table of them on stdout."""
    writer.truncate_after("eval_final", -1)
    rows = []
    for name in MODELS:
        m = summary["models"][name]
        row = {"stage": "eval_final", "step": int(config.ppo.steps), "arm": name,
               "kl": m["kl"]["mean"], "length": m["length_mean"]}
        if "rm_score" in m:
            row.update(rm_score=m["rm_score"]["mean"], rm_score_std=m["rm_score"]["std"],
                       rm_score_normalized=m["rm_score_normalized_mean"])
        if "gold" in m:
            row["gold"] = m["gold"]["mean"]
        if name == "policy" and "win_rate" in summary:
            row["win_rate"] = summary["win_rate"]["win_rate"]
        for key, value in summary.get("apps", {}).get(name, {}).items():
            row[key] = value
        writer.write(row)
        rows.append(row)
    columns = ["arm"] + [k for k in ("rm_score", "gold", "kl", "length", "win_rate")
                         if any(k in r for r in rows)]
    columns += [k for k in rows[0] if k.startswith("pass@")]
    print("[eval_final]\n" + summary_table(rows, columns))
