"""Stage `eval` on a tiny synthetic workdir: RM-score summaries, KL and gold recomputed with
transformers (torch) from the exported models, win rates under the rm, gold and OpenAI-compatible
judges (a local fake server), config errors; APPS pass@k by hand."""
import http.server
import json
import os
import re
import threading
import types

import numpy as np
import pytest

from marl_jax import stages
from marl_jax.config import base_config
from marl_jax.data import tasks as tasks_lib, synthetic
from marl_jax.eval import run_eval
from marl_jax.train.metrics import read_metrics

import real_util
from train_util import tiny_config


@pytest.fixture(scope="module", autouse=True)
def smollm2_run(request, tmp_path_factory):
    """Starts test_real_pipeline.py's SmolLM2 run now (when it is selected), to overlap it."""
    return real_util.start_smollm2_run(request.session, tmp_path_factory)


def _eval_config(**overrides):
    return tiny_config(**{"stage": "eval", "ppo.eval_every": 0, **overrides})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A finished SFT -> RM -> PPO run of the tiny synthetic pipeline."""
    path = str(tmp_path_factory.mktemp("tiny"))
    stages.run(tiny_config(**{"ppo.eval_every": 0}), path)
    return path


def _run_eval(workdir, **overrides):
    stages.run(_eval_config(**overrides), workdir)
    with open(os.path.join(workdir, "eval", "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "eval", "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    return summary, samples


def _prompt_ids(workdir):
    """The held-out prompts (unpadded token ids) and documents, rebuilt from the config."""
    task = tasks_lib.build_task(tiny_config(), workdir)
    prompts = [row[m.astype(bool)] for row, m in zip(task.eval["ids"], task.eval["mask"])]
    return prompts, task.eval["documents"], tasks_lib.synthetic_task_from_config(
        tiny_config().task)


@pytest.fixture(scope="module")
def rm_eval(workdir):
    summary, samples = _run_eval(workdir, **{"eval.judge": "rm"})
    return summary, samples, read_metrics(workdir, stage="eval_final")


@pytest.fixture(scope="module")
def torch_scores(workdir, rm_eval):
    """RM scores and policy-to-SFT KLs of the sampled responses, by transformers in torch, one
    unpadded sequence at a time."""
    import torch
    import transformers

    _, samples, _ = rm_eval
    prompts, _, _ = _prompt_ids(workdir)
    models_dir = os.path.join(workdir, "models")
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(
        os.path.join(models_dir, "rm")).eval()
    lms = {name: transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(models_dir, name)).eval() for name in ("sft", "policy")}
    temperature = tiny_config().ppo.temperature
    out = {"rm": {"sft": [], "policy": []}, "kl": []}
    with torch.no_grad():
        for s in samples:
            prompt = prompts[s["prompt_index"]].tolist()
            for name in ("sft", "policy"):
                ids = torch.tensor([prompt + s[name]["response_ids"]])
                # The score head on the last token (a sampled pad token included, which
                # transformers' pooling would skip).
                hidden = rm.model(ids).last_hidden_state
                out["rm"][name].append(float(rm.score(hidden)[0, -1, 0]))
            ids = torch.tensor([prompt + s["policy"]["response_ids"]])
            response = ids[0, len(prompt):]
            logps = {}
            for name, lm in lms.items():
                logits = lm(ids).logits[0, len(prompt) - 1:-1] / temperature
                logps[name] = torch.log_softmax(logits, -1)[torch.arange(len(response)), response]
            out["kl"].append(float((logps["policy"] - logps["sft"]).sum()))
    return {k: ({n: np.array(v) for n, v in val.items()} if isinstance(val, dict)
                else np.array(val)) for k, val in out.items()}


def _win_rate(ours, theirs):
    return float(np.mean(np.where(ours > theirs, 1.0, np.where(ours < theirs, 0.0, 0.5))))


def test_rm_scores_kl_and_rm_win_rate_match_torch(workdir, rm_eval, torch_scores):
    summary, samples, rows = rm_eval
    assert summary["num_prompts"] == len(samples) == 16
    for name in ("sft", "policy"):
        scores = torch_scores["rm"][name]
        np.testing.assert_allclose([s[name]["rm_score"] for s in samples], scores,
                                   rtol=1e-4, atol=1e-4)
        got = summary["models"][name]["rm_score"]
        assert got["mean"] == pytest.approx(scores.mean(), abs=1e-4)
        assert got["std"] == pytest.approx(scores.std(), abs=1e-4)
        assert sum(got["hist_counts"]) == 16
        with open(os.path.join(workdir, "models", "rm", "reward_stats.json")) as f:
            stats = json.load(f)
        assert summary["models"][name]["rm_score_normalized_mean"] == pytest.approx(
            ((scores - stats["mean"]) / stats["std"]).mean(), abs=1e-3)
        lengths = [len(s[name]["response_ids"]) for s in samples]
        assert summary["models"][name]["length_mean"] == pytest.approx(np.mean(lengths))
    np.testing.assert_allclose([s["policy"]["kl"] for s in samples], torch_scores["kl"],
                               rtol=1e-3, atol=1e-3)
    assert summary["models"]["sft"]["kl"]["mean"] == pytest.approx(0.0, abs=1e-5)
    expected = _win_rate(torch_scores["rm"]["policy"], torch_scores["rm"]["sft"])
    assert summary["win_rate"]["judge"] == "rm"
    assert summary["win_rate"]["win_rate"] == pytest.approx(expected)
    assert summary["win_rate"]["wins"] + summary["win_rate"]["losses"] + \
        summary["win_rate"]["ties"] == 16
    # One metrics row per model, with the summary's numbers.
    assert [r["arm"] for r in rows] == ["sft", "policy"]
    assert rows[1]["win_rate"] == summary["win_rate"]["win_rate"]
    assert rows[0]["rm_score"] == pytest.approx(torch_scores["rm"]["sft"].mean(), abs=1e-4)
    with open(os.path.join(workdir, "eval", "rm_scores.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_gold_judge_and_gold_scores(workdir, rm_eval):
    summary, samples = _run_eval(workdir, **{"eval.judge": "gold"})
    # Same seed, same samples as the rm-judged run.
    assert [s["policy"]["response_ids"] for s in samples] == \
        [s["policy"]["response_ids"] for s in rm_eval[1]]
    _, documents, task = _prompt_ids(workdir)
    gold = {}
    for name in ("sft", "policy"):
        length = max(len(s[name]["response_ids"]) for s in samples)
        ids = np.zeros((len(samples), length), np.int32)
        mask = np.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, :len(s[name]["response_ids"])] = s[name]["response_ids"]
            mask[i, :len(s[name]["response_ids"])] = 1
        docs = documents[[s["prompt_index"] for s in samples]]
        gold[name] = synthetic.gold_score_tokens(task, docs, ids, mask)
        assert summary["models"][name]["gold"]["mean"] == pytest.approx(gold[name].mean(),
                                                                         abs=1e-5)
    assert summary["win_rate"]["judge"] == "gold"
    assert summary["win_rate"]["win_rate"] == pytest.approx(_win_rate(gold["policy"],
                                                                      gold["sft"]))
    assert [s["policy_preference"] for s in samples] == [
        1.0 if p > q else 0.0 if p < q else 0.5 for p, q in zip(gold["policy"], gold["sft"])]


_SHOWN = re.compile(r"Summary A:\n(.*?)\n\nSummary B:\n(.*?)\n\nFIRST", re.DOTALL)


class _LengthJudgeServer(http.server.ThreadingHTTPServer):
    """OpenAI-compatible chat completions: the longer summary wins, equal lengths tie."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"headers": dict(self.headers), "body": body})
        first, second = _SHOWN.search(body["messages"][-1]["content"]).groups()
        verdict = "A" if len(first) > len(second) else "B" if len(first) < len(second) else "tie"
        data = json.dumps({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": f"Comparison: by length.\nPreferred: {verdict}"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())


def test_openai_judge_against_a_local_server(workdir, rm_eval, monkeypatch):
    server = _LengthJudgeServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    monkeypatch.setenv("MARL_JUDGE_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
    try:
        summary, samples = _run_eval(workdir, **{"eval.judge": "openai",
                                                 "eval.model": "judge-model",
                                                 "eval.judge_max_samples": 6})
    finally:
        server.shutdown()
        server.server_close()
    assert len(server.requests) == 6
    request = server.requests[0]
    assert request["body"]["model"] == "judge-model"
    assert request["headers"]["Authorization"] == "Bearer test-key"
    shown = [_SHOWN.search(r["body"]["messages"][-1]["content"]).groups()
             for r in server.requests]
    policy = [s["policy"]["response"] for s in samples[:6]]
    sft = [s["sft"]["response"] for s in samples[:6]]
    # Every pair was shown once, some in the swapped order; the verdicts are mapped back.
    assert sorted(map(sorted, shown)) == sorted(map(sorted, zip(policy, sft)))
    assert 0 < summary["win_rate"]["swapped"] < 6
    expected = [1.0 if len(p) > len(s) else 0.0 if len(p) < len(s) else 0.5
                for p, s in zip(policy, sft)]
    assert [s["policy_preference"] for s in samples[:6]] == expected
    assert all(s["policy_preference"] is None for s in samples[6:])
    assert summary["win_rate"]["win_rate"] == pytest.approx(np.mean(expected))
    assert summary["win_rate"]["n"] == 6 and summary["win_rate"]["failed"] == 0
    assert summary["win_rate"]["judge_model"] == "judge-model"


def test_eval_of_a_lora_workdir_gives_the_ppo_stage_last_evaluation(tmp_path):
    """A LoRA run (rank 4) exports merged models; the eval stage applies them with the adapters
    off and, in one batch of every held-out prompt, samples the policy as PPO's own last
    evaluation did (there on the unmerged adapters, in the training process)."""
    workdir, lora_rank = str(tmp_path), {"model.lora.rank": 4}
    stages.run(tiny_config(**lora_rank), workdir)
    ppo_last = read_metrics(workdir, stage="eval")[-1]
    assert ppo_last["step"] == tiny_config().ppo.steps
    stages.run(_eval_config(**lora_rank, **{"eval.batch_size": 16}), workdir)
    sft, policy = read_metrics(workdir, stage="eval_final")
    assert (sft["arm"], policy["arm"]) == ("sft", "policy")
    assert policy["length"] == ppo_last["length"]
    assert policy["gold"] == pytest.approx(ppo_last["gold"], abs=1e-6)
    assert policy["kl"] == pytest.approx(ppo_last["kl"], abs=1e-5)
    assert policy["rm_score_normalized"] == pytest.approx(ppo_last["rm_score"], abs=1e-4)


def test_eval_config_errors_come_before_compiling(workdir, tmp_path, monkeypatch):
    monkeypatch.delenv("MARL_JUDGE_MODEL", raising=False)
    with pytest.raises(ValueError, match="config.eval.judge='bogus'"):
        stages.run(_eval_config(**{"eval.judge": "bogus"}), workdir)
    with pytest.raises(ValueError, match="config.eval.model=''"):
        stages.run(_eval_config(**{"eval.judge": "openai"}), workdir)
    with pytest.raises(ValueError, match="config.eval.batch_size=3"):
        stages.run(_eval_config(**{"eval.batch_size": 3}), workdir)
    with pytest.raises(FileNotFoundError, match="--config.stage=sft"):
        stages.run(_eval_config(), str(tmp_path))


def test_apps_pass_at_k_by_hand():
    add = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    ident = {"fn_name": "f", "inputs": [[1], [2]], "outputs": [[1], [2]]}
    good_add, bad_add = "```python\n" + real_util.SUM_PROGRAM + "```", real_util.PRODUCT_PROGRAM
    good_f, bad_f = "def f(x):\n    return x\n", "def f(x):\n    return 1\n"
    # Problem 0: 2 of 5 programs correct; problem 1: 0 of 5 (each passes half the tests).
    texts = {"policy": [good_add, bad_add, good_add, "x = (", bad_add,
                        bad_f, bad_f, bad_f, bad_f, bad_f],
             "sft": [good_add] * 5 + [good_f] + [bad_f] * 4}
    task = types.SimpleNamespace(info={"eval_records": [{"input_output": add},
                                                        {"input_output": ident}]})
    config = base_config()
    config.eval.pass_at_k = (1, 2, 5)
    passed, summary = run_eval.apps_results(config, task, np.repeat([0, 1], 5), texts, 5)
    # pass@k = 1 - C(n - c, k) / C(n, k), averaged over the two problems.
    assert summary["policy"]["pass@1"] == pytest.approx((2 / 5 + 0) / 2)
    assert summary["policy"]["pass@2"] == pytest.approx((1 - 3 / 10 + 0) / 2)
    assert summary["policy"]["pass@5"] == pytest.approx((1 + 0) / 2)
    assert summary["sft"]["pass@1"] == pytest.approx((1 + 1 / 5) / 2)
    assert summary["sft"]["pass@5"] == pytest.approx(1.0)
    assert passed["policy"] == [1.0, 0.0, 1.0, 0.0, 0.0] + [0.5] * 5
    assert summary["policy"]["unit_test_reward_mean"] == pytest.approx(np.mean(passed["policy"]))
