"""The calculator task (marl_jax/envs/tasks.py) and multi-turn SFT: the SFT arrays are the chat
template's tokens of each whole demonstration, the action mask is 1 exactly on the assistant
turns' tokens, turn ids and masks by hand on one demonstration, the PPO / evaluation prompts are
the first prompts of their problem rows, the SFT loss on a trajectory is the cross-entropy of
its action tokens (numpy over the model's logits), a short SFT run through the pipeline lowers
it, and bad configs and conversations are one line."""
import numpy as np
import pytest

from marl_jax import envs
from marl_jax.config_check import validate_config
from marl_jax.data.tasks import build_task
from marl_jax.envs import calculator, tasks, transcripts
from marl_jax.train import build
from marl_jax.train.sft import sft_loss

from train_util import ROOT  # noqa: F401  (puts the repository root, and `configs`, on sys.path)
from configs import multiturn_synthetic  # noqa: E402


def tiny_calculator_config(**task):
    c = multiturn_synthetic.get_config()
    c.task.update(dict(num_sft=64, num_rl_prompts=8, num_eval_prompts=4, **task))
    c.model.config.update(dict(num_layers=1, intermediate_size=64))
    c.sft.update(dict(steps=40, batch_size=16))
    return c


@pytest.fixture(scope="module")
def task_and_demos(tmp_path_factory):
    config = tiny_calculator_config()
    data = build_task(config, str(tmp_path_factory.mktemp("calculator")))
    demos = calculator.demonstrations(tasks.calculator_task_from_config(config.task), 0, 64)
    return config, data, demos


def _template(tokenizer, messages, add_generation_prompt=False):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt))


def test_sft_arrays_are_the_chat_template_of_each_whole_demonstration(task_and_demos):
    _, data, demos = task_and_demos
    tok, sft = data.tokenizer, data.sft
    assert data.rm is None and sft["prompt_ids"].shape == (64, 32)
    assert sft["response_ids"].shape == (64, 72)
    for i, demo in enumerate(demos):
        prompt = sft["prompt_ids"][i][sft["prompt_mask"][i] == 1].tolist()
        length = int(sft["response_mask"][i].sum())
        assert sft["response_mask"][i, :length].all()  # left-aligned
        assert prompt == _template(tok, demo["messages"][:1], True)
        assert prompt + sft["response_ids"][i, :length].tolist() == _template(
            tok, demo["messages"])
        assert (sft["response_ids"][i, length:] == tok.pad_token_id).all()
        assert (sft["prompt_ids"][i][sft["prompt_mask"][i] == 0] == tok.pad_token_id).all()


def test_action_mask_is_one_exactly_on_the_assistant_turns_tokens(task_and_demos):
    _, data, demos = task_and_demos
    tok, sft = data.tokenizer, data.sft
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for i, demo in enumerate(demos):
        messages = demo["messages"]
        whole = _template(tok, messages)
        expected = np.zeros(len(whole), np.int32)
        for at, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # The assistant's content starts where the template's generation prompt ends.
            start = len(_template(tok, messages[:at], True))
            tokens = tok(message["content"], add_special_tokens=False)["input_ids"] + [end]
            assert whole[start:start + len(tokens)] == tokens
            expected[start:start + len(tokens)] = 1
        p = int(sft["prompt_mask"][i].sum())
        assert not expected[:p].any()
        np.testing.assert_array_equal(sft["action_mask"][i, :len(whole) - p], expected[p:])
        assert not sft["action_mask"][i, len(whole) - p:].any()


def test_turn_ids_and_masks_of_one_demonstration_by_hand(task_and_demos):
    _, data, demos = task_and_demos
    tok, sft = data.tokenizer, data.sft
    assert [m["content"] for m in demos[0]["messages"][1:]] == [
        "calc ( 17 - 6 )", "11", "calc ( 11 * 4 )", "44", "answer: 44"]
    words = ("calc ( 17 - 6 ) <|im_end|> <|im_start|> tool 11 <|im_end|> <|im_start|> assistant "
             "calc ( 11 * 4 ) <|im_end|> <|im_start|> tool 44 <|im_end|> <|im_start|> assistant "
             "answer: 44 <|im_end|>").split()
    assert tok.convert_ids_to_tokens(sft["response_ids"][0, :29].tolist()) == words
    # Turn 0: 7 action tokens, 6 observation tokens; turn 1 the same; turn 2: 3 action tokens,
    # then padding (43 tokens) carrying the last turn.
    np.testing.assert_array_equal(sft["action_mask"][0],
                                  [1] * 7 + [0] * 6 + [1] * 7 + [0] * 6 + [1] * 3 + [0] * 43)
    np.testing.assert_array_equal(sft["turn_ids"][0], [0] * 13 + [1] * 13 + [2] * 46)
    np.testing.assert_array_equal(sft["response_mask"][0], [1] * 29 + [0] * 43)


def test_rl_and_eval_prompts_are_the_first_prompts_of_fresh_problem_rows(task_and_demos,
                                                                         tmp_path):
    config, data, demos = task_and_demos
    tok = data.tokenizer
    for part, rows in (("rl", data.info["rl_rows"]), ("eval", data.info["eval_rows"])):
        arrays = getattr(data, part)
        assert len(rows) == len(arrays["ids"]) == {"rl": 8, "eval": 4}[part]
        for ids, mask, row in zip(arrays["ids"], arrays["mask"], rows):
            assert ids[mask == 1].tolist() == _template(
                tok, [{"role": "user", "content": row["problem"]}], True)
    problems = [{d["problem"] for d in demos}, {r["problem"] for r in data.info["rl_rows"]},
                {r["problem"] for r in data.info["eval_rows"]}]
    assert len(problems[0] | problems[1] | problems[2]) == 64 + 8 + 4
    env = envs.environment(data.environment["name"], **data.environment["kwargs"])
    assert (env.max_turns, env.max_value) == (4, 299)
    states, _ = env.reset(data.info["eval_rows"], range(4))
    answer = data.info["eval_rows"][0]["answer"]
    result = env.step(states[:1], [f"answer: {answer}"], [[]])
    assert result.rewards.tolist() == [1.0]
    again = build_task(config, str(tmp_path))
    for part in ("sft", "rl", "eval"):
        for key, value in getattr(data, part).items():
            np.testing.assert_array_equal(getattr(again, part)[key], value)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _policy(config, tokenizer, seed=0):
    import jax

    policy = build.policy_module(build.model_config(config, tokenizer))
    return policy, build.initial_policy_params(config, policy, jax.random.key(seed))


def _numpy_sft_loss(policy, params, batch, target_mask):
    """Mean -log p of the targets under `target_mask`, from the model's full logits."""
    ids = np.concatenate([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = np.concatenate([batch["prompt_mask"], batch["response_mask"]], 1)
    logits = np.asarray(policy.apply({"params": params}, ids, mask), np.float64)
    p = batch["prompt_ids"].shape[1]
    logp = _log_softmax(logits[:, p - 1:-1])
    target = np.take_along_axis(logp, batch["response_ids"][..., None], -1)[..., 0]
    return -(target * target_mask).sum() / target_mask.sum()


def test_multiturn_sft_loss_is_the_cross_entropy_of_the_action_tokens(task_and_demos):
    config, data, _ = task_and_demos
    policy, params = _policy(config, data.tokenizer)
    batch = {k: v[:4] for k, v in data.sft.items() if k != "turn_ids"}
    loss, _ = sft_loss(policy, params, batch)
    want = _numpy_sft_loss(policy, params, batch, batch["action_mask"])
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    single = {k: v for k, v in batch.items() if k != "action_mask"}
    all_tokens, _ = sft_loss(policy, params, single)
    np.testing.assert_allclose(float(all_tokens),
                               _numpy_sft_loss(policy, params, batch, batch["response_mask"]),
                               rtol=2e-5)
    assert abs(float(all_tokens) - float(loss)) > 1e-3


def test_a_short_sft_run_lowers_the_action_tokens_loss(tmp_path):
    from marl_jax import pipeline as pipeline_lib

    pipe = pipeline_lib.Pipeline(tiny_calculator_config(), str(tmp_path))
    try:
        batch = {k: v[:16] for k, v in pipe.task.sft.items() if k != "turn_ids"}
        # Before the stage runs: it donates the initial params' buffers.
        before = _numpy_sft_loss(pipe.policy, pipe.initial_params(), batch,
                                 batch["action_mask"])
        after = _numpy_sft_loss(pipe.policy, pipe.sft(), batch, batch["action_mask"])
    finally:
        pipe.close()
    # Uniform over the vocabulary at first; the calls' and answers' words once trained.
    assert before > 0.9 * np.log(len(pipe.task.tokenizer))
    assert after < 0.7 * before


def test_a_missing_calculator_task_field_is_one_line():
    c = multiturn_synthetic.get_config()
    validate_config(c)
    del c.task["max_turns"]
    with pytest.raises(ValueError) as error:
        validate_config(c, config_file="my_config.py")
    assert str(error.value) == (
        "config.task.name='calculator' needs the calculator task fields (max_turns) that "
        "my_config.py does not have; use --config=configs/multiturn_synthetic.py")


@pytest.mark.parametrize("field, value, message", [
    ("ppo.response_length", 28, "config.ppo.response_length=28: demonstration 0 takes 29 tokens "
                                "of actions and observations; raise config.ppo.response_length"),
    ("task.prompt_length", 20, "config.task.prompt_length=20: prompt 0 takes 27 tokens; raise "
                               "config.task.prompt_length"),
    ("task.max_turns", 2, "config.task.max_turns=2: the demonstrations take 3 assistant turns; "
                          "raise it"),
])
def test_a_demonstration_that_does_not_fit_is_one_line_naming_the_field(tmp_path, field, value,
                                                                          message):
    c = tiny_calculator_config()
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ValueError) as error:
        build_task(c, str(tmp_path))
    assert str(error.value) == message


@pytest.mark.parametrize("roles, message", [
    (("assistant", "user", "assistant"), "needs a prompt and then an assistant message"),
    (("user", "tool"), "needs a prompt and then an assistant message"),
    (("user", "assistant", "tool"), "ending with the assistant's"),
    (("user", "assistant", "tool", "user", "assistant"), "one observation each"),
])
def test_a_conversation_that_is_not_a_transcript_is_one_line(task_and_demos, roles, message):
    _, data, _ = task_and_demos
    messages = [{"role": role, "content": "calc ( 1 + 2 )"} for role in roles]
    with pytest.raises(ValueError, match=message) as error:
        transcripts.transcript_tokens(data.tokenizer, messages)
    assert "\n" not in str(error.value)
