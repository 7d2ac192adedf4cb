"""Real tasks: TaskData from fixture files in each public schema with the SmolLM2 tokenizer, the
APPS unit-test reward, a tiny-model APPS pipeline with evaluation, and SFT -> RM -> MA-PPO
(parsing termination) with the real SmolLM2-135M-Instruct through the command line."""
import copy
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import models, stages
from marl_jax.data import real_tasks
from marl_jax.eval import apps, unit_test_reward
from marl_jax.train.metrics import read_metrics

import process_util
import real_util
from configs import apps_smollm2, hh_rlhf_smollm2, tldr_smollm2, webgpt_smollm2

EOS = "<|im_end|>"


# ---- the SmolLM2 run starts first, in the background, and is checked at the end ------------
@pytest.fixture(scope="module", autouse=True)
def smollm2_run(request, tmp_path_factory):
    """`experiments/run.py --config=configs/tldr_smollm2.py` on the tldr fixture in its own
    process (one CPU device), overlapping the other tests of this module; it holds the lock of
    the whole-run tests (`process_util.one_at_a_time`) until the module ends."""
    with process_util.one_at_a_time():
        run = real_util.start_smollm2_run(request.session, tmp_path_factory)
        yield run
        if run is not None and run[0].poll() is None:
            run[0].kill()
            run[0].wait()


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return models.load_tokenizer(smollm2_gguf)


def _texts(tokenizer, ids, mask):
    return [tokenizer.decode(row[m.astype(bool)].tolist()) for row, m in zip(ids, mask)]


def _paper_parts(records, sizes):
    """DeepSpeed-Chat's split written out: shuffle 0..n-1 with RandomState(1234), cut by sizes."""
    order = np.random.RandomState(1234).permutation(len(records))
    cuts = np.cumsum((0,) + sizes)
    return [[records[i] for i in order[a:b]] for a, b in zip(cuts[:-1], cuts[1:])]


def _first_occurrences(values):
    return list(dict.fromkeys(values))


def _tldr_prompt(row):
    i = row["info"]
    return (f"SUBREDDIT: r/{i['subreddit']}\n\nTITLE: {i['title']}\n\nPOST: {i['post']}"
            "\n\nTL;DR:")


def _config(module, path, **task):
    c = module.get_config()
    c.task.path = str(path)
    c.task.update(task)
    return c


# ---- TaskData of each real dataset ---------------------------------------------------------
def test_tldr_split_prompts_and_responses(tmp_path, tokenizer):
    rows = real_util.write_tldr(tmp_path / "data")
    cfg = _config(tldr_smollm2, tmp_path / "data", use_chat_template=False, num_eval_prompts=4)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "run"), tokenizer=tokenizer)

    def texts(row):
        s = [x["text"].strip() for x in row["summaries"]]
        return " " + s[row["choice"]], " " + s[1 - row["choice"]]

    sft, rm, rl = _paper_parts(rows["train"], (8, 16, 16))
    assert _texts(tokenizer, task.sft["prompt_ids"], task.sft["prompt_mask"]) == \
        [_tldr_prompt(r) for r in sft]
    assert _texts(tokenizer, task.sft["response_ids"], task.sft["response_mask"]) == \
        [texts(r)[0] + EOS for r in sft]
    assert _texts(tokenizer, task.rm["prompt_ids"], task.rm["prompt_mask"]) == \
        [_tldr_prompt(r) for r in rm]
    assert _texts(tokenizer, task.rm["chosen_ids"], task.rm["chosen_mask"]) == \
        [texts(r)[0] + EOS for r in rm]
    assert _texts(tokenizer, task.rm["rejected_ids"], task.rm["rejected_mask"]) == \
        [texts(r)[1] + EOS for r in rm]
    assert _texts(tokenizer, task.rl["ids"], task.rl["mask"]) == \
        _first_occurrences(_tldr_prompt(r) for r in rl)
    # Held out: the validation split (its CNN/DM row dropped), capped at 4 prompts.
    assert _texts(tokenizer, task.eval["ids"], task.eval["mask"]) == \
        [_tldr_prompt(r) for r in rows["validation"][:4]]
    assert [r["raw_prompt"] for r in task.info["eval_records"]] == \
        [_tldr_prompt(r) for r in rows["validation"][:4]]
    # Arrays: left-padded prompts, left-aligned responses of the configured lengths.
    assert task.rl["ids"].shape == (len(task.rl["ids"]), 192)
    assert task.sft["response_ids"].shape == (8, 48)
    assert np.all(task.rl["mask"][:, -1] == 1)
    assert np.all(task.sft["response_mask"][:, 0] == 1)
    assert task.info["loads"][0]["skipped"] == {"choice not 0 or 1": 1}
    stats = json.loads((tmp_path / "run" / real_tasks.STATS_FILE).read_text())
    assert stats["counts"] == {"sft": 8, "rm": 16, "rl": len(task.rl["ids"]), "eval": 4}


def test_hh_rlhf_chat_template_prompts(tmp_path, tokenizer):
    rows = real_util.write_hh(tmp_path / "data")
    cfg = _config(hh_rlhf_smollm2, tmp_path / "data", use_chat_template=True, num_eval_prompts=0)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "run"), tokenizer=tokenizer)

    def chat(turns):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

    pairs = list(zip(rows["train"], rows["train_turns"]))
    sft, rm, rl = _paper_parts(pairs, (6, 12, 12))
    assert _texts(tokenizer, task.sft["prompt_ids"], task.sft["prompt_mask"]) == \
        [chat(t) for _, t in sft]
    # With a chat template the response loses the space that joined it to the plain prompt.
    assert _texts(tokenizer, task.rm["chosen_ids"], task.rm["chosen_mask"]) == \
        ["Talk to them calmly and explain how you feel." + EOS] * 12
    assert _texts(tokenizer, task.rl["ids"], task.rl["mask"]) == [chat(t) for _, t in rl]
    assert _texts(tokenizer, task.eval["ids"], task.eval["mask"]) == \
        [chat(t) for t in rows["test_turns"]]
    assert task.info["loads"][0]["dropped"] == {"identical chosen and rejected": 1}


def test_webgpt_holds_out_the_last_rl_prompts(tmp_path, tokenizer):
    rows = real_util.write_webgpt(tmp_path / "data")
    cfg = _config(webgpt_smollm2, tmp_path / "data", use_chat_template=False, num_eval_prompts=3)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "run"), tokenizer=tokenizer)
    sft, _, rl = _paper_parts(rows["train"], (6, 12, 12))
    prompts = [f" Human: {r['question']['full_text']} Assistant:" for r in rl]
    assert _texts(tokenizer, task.rl["ids"], task.rl["mask"]) == prompts[:9]
    assert _texts(tokenizer, task.eval["ids"], task.eval["mask"]) == prompts[9:]
    # Citation markers are removed from the answers.
    assert _texts(tokenizer, task.sft["response_ids"], task.sft["response_mask"]) == \
        [f" {r['answer_0'].replace(' [1]', '')}{EOS}" for r in sft]


def test_apps_problems_solutions_and_test_split(tmp_path, tokenizer):
    rows = real_util.write_apps(tmp_path / "data")
    cfg = _config(apps_smollm2, tmp_path / "data", use_chat_template=False, num_eval_prompts=0)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "run"), tokenizer=tokenizer)

    def prompt(row):
        tests = json.loads(row["input_output"])
        starter = "\n" + row["starter_code"] if row["starter_code"] else ""
        kind = "Call-Based" if "fn_name" in tests else "Standard Input"
        return f"\nQUESTION:\n{row['question']}{starter}\nUse {kind} format\nANSWER:\n"

    sft, rm, rl = _paper_parts(rows["train"], (4, 8, 8))
    assert _texts(tokenizer, task.sft["prompt_ids"], task.sft["prompt_mask"]) == \
        [prompt(r) for r in sft]
    assert _texts(tokenizer, task.sft["response_ids"], task.sft["response_mask"]) == \
        [json.loads(r["solutions"])[0] + EOS for r in sft]
    assert task.rm["prompt_ids"].shape == (0, 256)
    assert _texts(tokenizer, task.rl["ids"], task.rl["mask"]) == [prompt(r) for r in rl]
    assert task.rl_unit_tests == [json.loads(r["input_output"]) for r in rl]
    assert task.host_reward is None, "the caller hands the task its unit-test reward"
    assert [r["problem_id"] for r in task.info["eval_records"]] == \
        [r["problem_id"] for r in rows["test"]]
    assert task.info["loads"][0]["skipped"] == {"input_output is not valid JSON": 1}


def test_length_filter_and_caps(tmp_path, tokenizer):
    rows = real_util.write_tldr(tmp_path / "data")
    sft, rm, _ = _paper_parts(rows["train"], (8, 16, 16))

    def prompt_tokens(row):
        return len(tokenizer(_tldr_prompt(row))["input_ids"])

    limit = int(np.median([prompt_tokens(r) for r in sft + rm]))
    cfg = _config(tldr_smollm2, tmp_path / "data", use_chat_template=False, num_pairs=5,
                  max_prompt_length=limit)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "run"), tokenizer=tokenizer)
    fitting_sft = [r for r in sft if prompt_tokens(r) <= limit]
    fitting_rm = [r for r in rm if prompt_tokens(r) <= limit]
    assert len(task.sft["prompt_ids"]) == len(fitting_sft) < 8
    assert len(task.rm["prompt_ids"]) == 5 < len(fitting_rm)
    assert task.info["dropped"]["sft"] == 8 - len(fitting_sft)
    assert task.sft["prompt_ids"].shape[1] == limit


def test_config_errors_name_the_field(tmp_path, tokenizer):
    real_util.write_apps(tmp_path / "data")
    cfg = _config(apps_smollm2, tmp_path / "data")
    cfg.rm.steps = 3
    with pytest.raises(ValueError, match="config.rm.steps=3"):
        real_tasks.build_real_task(cfg, str(tmp_path), tokenizer=tokenizer)
    cfg = _config(tldr_smollm2, tmp_path / "data", name="imdb")
    with pytest.raises(ValueError, match="config.task.name='imdb'"):
        real_tasks.build_real_task(cfg, str(tmp_path), tokenizer=tokenizer)
    cfg = _config(tldr_smollm2, tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="missing"):
        real_tasks.build_real_task(cfg, str(tmp_path), tokenizer=tokenizer)


# ---- APPS: the unit-test reward ------------------------------------------------------------
def test_apps_unit_test_reward(tokenizer):
    scale = {"fn_name": "scale", "inputs": [[1], [5]], "outputs": [[3], [15]]}
    responses = [
        f"Here you go:\n```python\n{real_util.SUM_PROGRAM}```\nDone.",  # fenced, all 3 pass
        real_util.PRODUCT_PROGRAM,  # 2 * 2 == 2 + 2: one test of three
        "```\nprint(int(input().split()[0]) +\n",  # unclosed fence, does not compile
        "def scale(x):\n    return 3 * x\n",  # call-based, both pass
    ]
    ids, mask = (np.asarray(x) for x in _encode(tokenizer, responses, 64))
    reward = unit_test_reward.UnitTestReward(tokenizer, [real_util.SUM_TESTS, scale], timeout_s=2.0)
    got = reward(np.array([0, 0, 0, 1]), ids, mask)
    np.testing.assert_allclose(got, [1.0, 1 / 3, 0.0, 1.0])
    assert got.dtype == np.float32
    with pytest.raises(ValueError, match="rows must index"):
        reward(np.array([0, 0, 0, 2]), ids, mask)


def _encode(tokenizer, texts, length):
    from marl_jax.data import collate

    return collate.encode_responses(tokenizer, texts, length)


# ---- a tiny model on APPS: SFT, PPO on unit tests, pass@k ----------------------------------
def test_tiny_model_apps_pipeline_and_pass_at_k(tmp_path, smollm2_gguf, tokenizer):
    rows = real_util.write_apps(tmp_path / "data")
    cfg = _config(apps_smollm2, tmp_path / "data", use_chat_template=False, tokenizer=str(
        smollm2_gguf), max_prompt_length=48, num_eval_prompts=3)
    cfg.model.path = ""
    cfg.model.config.update(dict(family="llama", hidden_size=32, intermediate_size=64,
                                 num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=128))
    cfg.sft.update(dict(steps=2, batch_size=8))
    cfg.rm.batch_size = 8
    cfg.ppo.update(dict(steps=2, batch_size=8, response_length=24, eval_every=0))
    cfg.eval.update(dict(batch_size=8, num_samples=2, pass_at_k=(1, 2)))
    workdir = str(tmp_path / "run")
    stages.run(cfg, workdir)
    ppo = [r for r in read_metrics(workdir) if r["stage"] == "ppo"]
    assert [r["step"] for r in ppo] == [1, 2]
    # A random tiny model writes no working program: the unit-test reward is 0.
    assert all(r["objective/raw_scores"] == 0.0 for r in ppo)
    cfg.stage = "eval"
    stages.run(cfg, workdir)
    summary = json.loads(pathlib.Path(workdir, "eval", "summary.json").read_text())
    samples = [json.loads(line) for line in open(os.path.join(workdir, "eval", "samples.jsonl"))]
    assert summary["apps"]["num_problems"] == 3 and len(samples) == 6
    assert [s["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    tests = {r["problem_id"]: json.loads(r["input_output"]) for r in rows["test"]}
    for name in ("sft", "policy"):
        # pass@k recomputed: run each sampled program again, count correct ones per problem.
        correct = [all(apps.run_solution(real_tasks.extract_code(s[name]["response"]),
                                         tests[5000 + s["prompt_index"]], 2.0))
                   for s in samples]
        for k in (1, 2):
            expected = np.mean([1 - math.comb(2 - c, k) / math.comb(2, k)
                                for c in np.add.reduceat(correct, [0, 2, 4])])
            assert summary["apps"][name][f"pass@{k}"] == pytest.approx(expected)
        assert "rm_score" not in summary["models"][name]


# ---- the real SmolLM2 through SFT, RM and MA-PPO with parsing-based macros -----------------
def _logits(model, params, ids):
    return np.asarray(jax.jit(model.apply)({"params": params}, ids, jnp.ones_like(ids)))


SMOKE_IDS = jnp.asarray([[1, 9690, 198, 504, 3458, 28, 2]], jnp.int32)


@pytest.fixture(scope="module")
def smollm2_initial(smollm2_gguf):
    model, params = models.load_pretrained(smollm2_gguf)
    return model, _logits(model, params, SMOKE_IDS)


def test_smollm2_sft_rm_ma_ppo_with_parsing_end_to_end(smollm2_run, smollm2_initial):
    from transformers import AutoConfig

    assert smollm2_run is not None, "the SmolLM2 run did not start"
    process, workdir, log = smollm2_run
    assert process.wait(timeout=900) == 0, pathlib.Path(log).read_text()[-5000:]
    rows = read_metrics(workdir)
    for stage in ("sft", "rm", "ppo"):
        stage_rows = [r for r in rows if r["stage"] == stage]
        assert [r["step"] for r in stage_rows] == [1, 2], stage
        for r in stage_rows:
            numbers = {k: v for k, v in r.items() if isinstance(v, float)}
            assert numbers and all(np.isfinite(v) for v in numbers.values()), (stage, r)
    ppo = [r for r in rows if r["stage"] == "ppo"]
    for r in ppo:
        assert 0.0 <= r["macro/parse_fallback_frac"] <= 1.0
        assert r["macro/parse_macro_len_mean"] >= 1.0
        assert {"objective/kl", "objective/scores", "loss/policy_avg",
                "loss/value_avg"} <= set(r)

    exported = {name: os.path.join(workdir, "models", name) for name in ("sft", "rm", "policy")}
    for name, path in exported.items():
        hf = AutoConfig.from_pretrained(path)
        assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == \
            ("llama", 30, 576, 49152), name
    assert AutoConfig.from_pretrained(exported["rm"]).architectures == \
        ["LlamaForSequenceClassification"]
    stats = json.loads(pathlib.Path(exported["rm"], "reward_stats.json").read_text())
    assert np.isfinite(stats["mean"]) and stats["std"] > 0
    _, rm_params = models.load_pretrained(exported["rm"], head="scalar")
    assert rm_params["head"]["kernel"].shape == (576, 1)

    model, initial_logits = smollm2_initial
    logits = {}
    for name in ("sft", "policy"):
        _, params = models.load_pretrained(exported[name])
        logits[name] = _logits(model, params, SMOKE_IDS)
        assert np.all(np.isfinite(logits[name]))
    assert np.abs(logits["sft"] - initial_logits).max() > 1e-3
    assert np.abs(logits["policy"] - logits["sft"]).max() > 1e-4


def test_prompts_start_with_bos_when_the_tokenizer_adds_one(tmp_path, tokenizer):
    """Gemma / Llama tokenizers add BOS; prompts are encoded without special tokens, so the
    task writes it into the prompt (once; a chat template writes its own)."""
    from tokenizers import processors

    bos_tokenizer = copy.deepcopy(tokenizer)
    bos_tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token,
                                                             tokenizer.bos_token_id)])
    assert bos_tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id
    real_util.write_tldr(tmp_path / "data")
    cfg = _config(tldr_smollm2, tmp_path / "data", use_chat_template=False, num_eval_prompts=2)
    plain = real_tasks.build_real_task(cfg, str(tmp_path / "a"), tokenizer=tokenizer)
    task = real_tasks.build_real_task(cfg, str(tmp_path / "b"), tokenizer=bos_tokenizer)
    for part in ("rl", "eval"):
        lengths = getattr(task, part)["mask"].sum(axis=1)
        np.testing.assert_array_equal(lengths, getattr(plain, part)["mask"].sum(axis=1) + 1)
        first = getattr(task, part)["ids"][np.arange(len(lengths)), -lengths]
        assert np.all(first == tokenizer.bos_token_id)
    np.testing.assert_array_equal(task.sft["response_ids"], plain.sft["response_ids"])


def test_pretrained_weights_are_read_once(tmp_path, monkeypatch):
    """A GGUF file is read in full for its config and the weights are kept for the policy init;
    an HF directory's config comes from config.json alone."""
    from marl_jax.train import build

    cfg_model = models.ModelConfig.for_family(
        "llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
    module = models.CausalLM(cfg_model)
    params = models.init_params(module, jax.random.key(0))
    reads = []

    def fake_load_pretrained(path, dtype=jnp.float32, **kwargs):
        reads.append((path, jnp.dtype(dtype)))
        return module, params

    monkeypatch.setattr(build.models, "load_pretrained", fake_load_pretrained)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    config = tldr_smollm2.get_config()
    config.model.path = str(gguf)
    config.model.dtype = "bfloat16"
    got = build.model_config(config, tokenizer=None)
    assert (got.hidden_size, got.dtype, got.param_dtype) == (16, "bfloat16", "float32")
    assert build.initial_policy_params(config, module, jax.random.key(1)) is params
    assert reads == [(str(gguf), jnp.dtype("float32"))]

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg_model.to_hf()))
    config.model.path = str(hf_dir)
    assert build.model_config(config, tokenizer=None).hidden_size == 16
    assert len(reads) == 1
    build.initial_policy_params(config, module, jax.random.key(1))
    assert reads[1:] == [(str(hf_dir), jnp.dtype("float32"))]
    config.model.path = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.model.path"):
        build.model_config(config, tokenizer=None)
