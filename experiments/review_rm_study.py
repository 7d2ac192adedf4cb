"""Reward models of the review task compared on held-out pairs: how the reward model of
configs/real_text_smollm2.py (cpu size) was chosen.

    python experiments/review_rm_study.py --workdir=runs/rm_study                 # every setting
    python experiments/review_rm_study.py --workdir=runs/rm_study --only=shipped,pairs_lr3e-5

A setting is a set of config overrides of the cpu size (`SETTINGS`). Every setting starts from
the same instruct-model samples and SFT policy (`<workdir>/base`, the pipeline's own first
stages) and trains its reward model with the pipeline in `<workdir>/<setting>`. They are
compared on `--dev_prompts` prompts of the review task that no part of any setting uses (cut
after the first `DEV_OFFSET` of the seeded permutation), 4 samples of the instruct model each,
every pair of a prompt's samples whose gold differs labelled by the gold alone:

- agreement: the fraction of those pairs the reward model orders as the gold does;
- correlation: Pearson's r between the reward model's scores and the gold over the responses,
  both centred within each prompt (what a policy gradient on one prompt sees); the same for
  each of the gold's terms;
- rm_eval: the pipeline's `rm/gold_agreement` (the pairs of the config's rm_eval part).

Writes `<workdir>/results.json` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> config overrides of the cpu size (dotted fields).
PAIRS = {"rm.group_by_prompt": False, "rm.batch_size": 8, "task.num_pairs": 96}
PROMPTS_96 = {"rm.group_by_prompt": True, "rm.batch_size": 4, "task.num_pairs": 96}
SETTINGS = {
    "pairs_lr3e-5": dict(PAIRS, **{"rm.learning_rate": 3e-5}),
    "pairs_lr3e-4": dict(PAIRS, **{"rm.learning_rate": 3e-4}),
    "pairs_lr1e-3": dict(PAIRS, **{"rm.learning_rate": 1e-3}),
    "prompts_lr3e-4": dict(PROMPTS_96, **{"rm.learning_rate": 3e-4}),
    "prompts_lr1e-3": dict(PROMPTS_96, **{"rm.learning_rate": 1e-3}),
    "shipped": {},
}
DEV_OFFSET = 4000  # every part of every setting lies within the first prompts of the permutation
SAMPLES = 4


def setting_config(overrides: dict):
    from configs import real_text_smollm2
    from marl_jax.config import resolve_size, set_field

    config = resolve_size(real_text_smollm2.get_config())
    for dotted, value in overrides.items():
        set_field(config, dotted, value)
    return config


def parts_end(config) -> int:
    from marl_jax.data import review_task

    return sum(int(config.task[field]) for field in review_task.SIZE_FIELDS.values())


def dev_set(pipe, config, num_prompts: int, path: str) -> dict:
    """The dev prompts' records, `SAMPLES` responses of the instruct model to each and their
    gold and gold terms (sampled once, kept in `path`)."""
    import jax

    from marl_jax.data import collate, reviews
    from marl_jax.data.chat import format_records
    from marl_jax.data.real_tasks import decode_responses
    from marl_jax.train import ppo as ppo_lib, sampled_data

    records = reviews.review_prompts(int(config.task.data_seed), {
        "skip": DEV_OFFSET, "dev": num_prompts})["dev"]
    tokenizer = pipe.task.tokenizer
    rows = list(format_records([dict(r, raw_prompt=r["prompt"]) for r in records], tokenizer,
                               bool(config.task.use_chat_template)))
    ids, mask = collate.encode_prompts(tokenizer, [r["prompt"] for r in rows],
                                       int(config.task.max_prompt_length))
    if not os.path.exists(path):
        static = ppo_lib.static_from_config(config, tokenizer)
        responses, response_mask = sampled_data.sample_responses(
            pipe.policy, pipe.initial_params(), dict(ids=ids, mask=mask), num_samples=SAMPLES,
            key=jax.random.key(987), batch_size=int(config.task.sample_batch_size),
            sampler=dict(max_new_tokens=int(config.ppo.response_length),
                         temperature=static.temperature, top_k=static.top_k, top_p=static.top_p,
                         eos_id=static.eos_id, pad_id=static.pad_id), desc="sample dev")
        np.savez(path, ids=responses, mask=response_mask)
    with np.load(path) as f:
        responses, response_mask = f["ids"], f["mask"]
    width = responses.shape[-1]
    texts = decode_responses(tokenizer, responses.reshape(-1, width),
                             response_mask.reshape(-1, width))
    repeated = [r for r in records for _ in range(SAMPLES)]
    terms = pipe.gold.terms(repeated, texts)
    return dict(prompt_ids=ids, prompt_mask=mask, ids=responses, mask=response_mask,
                gold=pipe.gold.score(repeated, texts).reshape(-1, SAMPLES),
                terms={k: v.reshape(-1, SAMPLES) for k, v in terms.items()})


def dev_scores(pipe, rm_params, dev: dict, frozen_layers: int) -> np.ndarray:
    """The reward model's scores `[N, SAMPLES]` of the dev responses. Its frozen bottom layers
    are the SFT policy's in every setting, so their states are computed once per depth."""
    import jax

    from marl_jax.models.heads import trunk_states
    from marl_jax.train import reward

    n, k, width = dev["ids"].shape
    mask = np.concatenate([np.repeat(dev["prompt_mask"], k, 0),
                           dev["mask"].reshape(n * k, width)], axis=1).astype(np.int32)
    cache = dev.setdefault("trunks", {})
    if frozen_layers not in cache:
        ids = np.concatenate([np.repeat(dev["prompt_ids"], k, 0), dev["ids"].reshape(n * k, width)],
                             axis=1)
        run = jax.jit(lambda p, b: trunk_states(pipe.reward_model.config, p, b["ids"], b["mask"],
                                                frozen_layers))
        cache[frozen_layers] = reward._per_sequence(run, rm_params, dict(ids=ids, mask=mask), 16)
    score = jax.jit(lambda p, b: reward.trunk_sequence_scores(pipe.reward_model, p, b,
                                                              frozen_layers))
    states = dict(states=cache[frozen_layers], mask=mask)
    return reward._per_sequence(score, rm_params, states, 16).reshape(n, k)


def compare(scores: np.ndarray, dev: dict) -> dict:
    gold = dev["gold"]
    agree = []
    for i in range(len(gold)):
        for a in range(SAMPLES):
            for b in range(a + 1, SAMPLES):
                same = (np.array_equal(dev["mask"][i, a], dev["mask"][i, b]) and np.array_equal(
                    dev["ids"][i, a] * dev["mask"][i, a], dev["ids"][i, b] * dev["mask"][i, b]))
                if gold[i, a] != gold[i, b] and not same:
                    agree.append((scores[i, a] > scores[i, b]) == (gold[i, a] > gold[i, b]))
    centred = lambda x: (x - x.mean(axis=1, keepdims=True)).ravel()

    def corr(x):
        x = centred(np.asarray(x, np.float64))
        return float(np.corrcoef(centred(scores), x)[0, 1]) if x.std() > 0 else None

    return dict(agreement=float(np.mean(agree)), pairs=len(agree), correlation=corr(gold),
                term_correlation={k: corr(v) for k, v in dev["terms"].items()})


def run_setting(name: str, overrides: dict, workdir: str, base_config, dev: dict) -> dict:
    from marl_jax.pipeline import Pipeline
    from marl_jax.train import reward
    from marl_jax.train.metrics import read_metrics

    config = setting_config(overrides)
    if parts_end(config) > DEV_OFFSET:
        raise ValueError(f"setting {name!r}: its parts need {parts_end(config)} prompts, more "
                         f"than the {DEV_OFFSET} before the dev prompts")
    base, here = os.path.join(workdir, "base"), os.path.join(workdir, name)
    if not os.path.exists(here):
        os.makedirs(os.path.join(here, "checkpoints"))
        shutil.copytree(os.path.join(base, "sampled"), os.path.join(here, "sampled"))
        if config.task.num_pairs != base_config.task.num_pairs:  # sampled again, same keys
            for suffix in (".npz", ".jsonl"):
                os.remove(os.path.join(here, "sampled", "rm" + suffix))
        os.symlink(os.path.abspath(os.path.join(base, "checkpoints", "sft")),
                   os.path.join(here, "checkpoints", "sft"))
    pipe = Pipeline(config, here)
    rm_params, _ = pipe.rm()
    frozen = reward.frozen_trunk_layers(rm_params, int(config.rm.num_layers_unfrozen))
    out = dict(setting=name, overrides=overrides,
               **compare(dev_scores(pipe, rm_params, dev, frozen), dev))
    pipe.close()
    rows = [r for r in read_metrics(here) if "rm/gold_agreement" in r]
    out.update(rm_eval=rows[-1]["rm/gold_agreement"], rm_eval_pairs=rows[-1]["rm/gold_pairs"])
    return out


def table(results: list) -> str:
    lines = ["| setting | agreement | correlation within prompts | tone | aspects | ending | "
             "length | rm_eval agreement |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["term_correlation"]
        lines.append(f"| `{r['setting']}` | {r['agreement']:.3f} ({r['pairs']} pairs) | "
                     f"{r['correlation']:.2f} | {t['tone']:.2f} | {t['aspects']:.2f} | "
                     f"{t['ending']:.2f} | {t['length']:.2f} | {r['rm_eval']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/rm_study")
    parser.add_argument("--only", default="", help="comma-separated settings (default: all)")
    parser.add_argument("--dev_prompts", type=int, default=192)
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SETTINGS)
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {sorted(SETTINGS)}")
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, "results.json")
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            done = {r["setting"]: r for r in json.load(f)}
    todo = [n for n in names if n not in done]
    if todo:
        from marl_jax.pipeline import Pipeline
        from marl_jax.train import compile_cache

        compile_cache.use_run_cache()
        # The instruct model's samples and the SFT policy, once for every setting.
        base_config = setting_config({})
        base = Pipeline(base_config, os.path.join(args.workdir, "base"))
        base.sft()
        dev = dev_set(base, base_config, args.dev_prompts, os.path.join(args.workdir, "dev.npz"))
        base.close()
        for name in todo:
            done[name] = run_setting(name, SETTINGS[name], args.workdir, base_config, dev)
            with open(path, "w") as f:
                json.dump(list(done.values()), f, indent=2)
    print(table([done[n] for n in names]))


if __name__ == "__main__":
    main()
