"""Multi-turn environments: the rewards and observations of each environment on hand-made
transcripts, the chat-turn spans against the chat template of the whole conversation, a failing
row flagged beside untouched ones, the calculator's demonstrations replayed to reward 1, the safe
arithmetic parser against Python's on random expressions and refusing everything else, and the
rollout's host callback on one transcript."""
import json
import random
import re

import numpy as np
import pytest
from test_layering import import_graph
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from marl_jax import envs
from marl_jax.envs import arithmetic, calculator, chat_turns
from marl_jax.envs.apps_repair import AppsRepairEnvironment
from marl_jax.envs.calculator import CalculatorEnvironment

# SmolLM2-135M-Instruct's chat template, as its tokenizer ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML that drops an assistant turn's reasoning once another message follows it, as
# reasoning models' templates do.
STRIPS_REASONING_TEMPLATE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NO_END_TOKEN_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def _byte_bpe(template):
    """A byte-level BPE tokenizer (trained here on a few lines) with ChatML's special tokens."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = ["You are a helpful AI assistant named SmolLM, trained by Hugging Face",
              "system user assistant tool", "what is 12 times 4? the answer is 48.\n\n"] * 4
    raw.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"],
                                   chat_template=template)


@pytest.fixture(scope="module")
def bpe_chatml():
    return _byte_bpe(SMOLLM2_TEMPLATE)


@pytest.fixture(scope="module")
def calc_tokenizer(tmp_path_factory):
    return calculator.build_tokenizer(calculator.CalculatorTask(),
                                      str(tmp_path_factory.mktemp("calc") / "tokenizer"))


def _template_ids(tokenizer, messages, add_generation_prompt):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt))


# ---- chat turns ----------------------------------------------------------------------------
def test_chat_turn_spans_are_the_template_of_the_whole_conversation_minus_its_earlier_part(
        bpe_chatml):
    tok = bpe_chatml
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat_turns.end_of_turn_ids(tok) == (end,)
    conversation = [{"role": "user", "content": "what is 12 times 4?"},
                    {"role": "assistant", "content": "calc(12*4)"},
                    {"role": "tool", "content": "48"},
                    {"role": "assistant", "content": "the answer is 48."},
                    {"role": "user", "content": "and 13 times 4?"}]
    trajectory = chat_turns.prompt_ids(tok, conversation[:1])
    for turn in (1, 3):
        action = tok(conversation[turn]["content"], add_special_tokens=False)["input_ids"]
        span = chat_turns.observation_span(tok, conversation[:turn + 1],
                                           conversation[turn + 1]["content"],
                                           role=conversation[turn + 1]["role"])
        # ChatML's newline after <|im_end|> closes the assistant turn beyond the sampled token;
        # the span ends by opening the next assistant turn.
        assert span[:2] == [tok.convert_tokens_to_ids("Ċ"),
                            tok.convert_tokens_to_ids("<|im_start|>")]
        opening = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        assert span[-len(opening):] == opening
        trajectory += action + [end] + span
    assert trajectory == _template_ids(tok, conversation, True)


@pytest.mark.parametrize("case, message", [
    ("strips_reasoning", "renders the earlier turns differently once a user message follows"),
    ("no_end_token", "closes an assistant message with no special token"),
    ("no_template", "has no chat_template"),
])
def test_chat_turns_refuse_templates_they_cannot_extend(case, message):
    template = {"strips_reasoning": STRIPS_REASONING_TEMPLATE,
                "no_end_token": NO_END_TOKEN_TEMPLATE, "no_template": None}[case]
    tok = _byte_bpe(template)
    conversation = [{"role": "user", "content": "what is 12 times 4?"},
                    {"role": "assistant", "content": "<think>12*4</think>48"}]
    with pytest.raises(ValueError, match=re.escape(message)):
        chat_turns.observation_span(tok, conversation, "and 13 times 4?")


# ---- the safe arithmetic parser ----------------------------------------------------------
def _random_expression(rng, depth=0):
    choice = rng.random()
    if depth > 3 or choice < 0.3:
        return str(rng.randrange(0, 50))
    if choice < 0.4:
        return "- " + _random_expression(rng, depth + 1)
    if choice < 0.55:
        return "( " + _random_expression(rng, depth + 1) + " )"
    operator = rng.choice(["+", "-", "*"])
    return (_random_expression(rng, depth + 1) + rng.choice(["", " "]) + operator
            + rng.choice(["", " "]) + _random_expression(rng, depth + 1))


def test_arithmetic_agrees_with_python_on_random_expressions_of_the_grammar():
    rng = random.Random(0)
    expressions = [_random_expression(rng) for _ in range(300)]
    assert len({e for e in expressions if "*" in e and "(" in e}) > 20
    for text in expressions:
        assert arithmetic.evaluate(text) == eval(text), text  # the test's reference, not the env's
    assert arithmetic.evaluate(" 10 - 2 - 3 ") == 5  # left-associative
    assert arithmetic.evaluate("2 + 3 * 4") == 14 and arithmetic.evaluate("(2 + 3) * 4") == 20


@pytest.mark.parametrize("text", [
    "2 ** 3", "7 / 2", "7 // 2", "2.5 + 1", "1e3", "__import__('os').system('true')", "abs(3)",
    "x + 1", "2 +", "(2 + 3", "2 + 3)", "()", "", "   ", "2 3", "\u0663 + 1", "0x10",
    "(" * 40 + "1" + ")" * 40, "1 + " * 100 + "1",
])
def test_arithmetic_refuses_anything_but_the_grammar(text):
    with pytest.raises(arithmetic.ExpressionError):
        arithmetic.evaluate(text)


# ---- the environments on hand-made transcripts -------------------------------------------
def _play(environment, row, actions, seed=0):
    """[(observation, reward, done)] of one row stepped through `actions`."""
    states, _ = environment.reset([row], [seed])
    steps = []
    for action in actions:
        result = environment.step(states, [action], [[]])
        assert not result.failed[0]
        states = result.states
        steps.append((result.observations[0], float(result.rewards[0]), bool(result.done[0])))
    return steps


def test_calculator_rewards_and_observations_by_hand():
    env = envs.environment("calculator", max_turns=7)
    row = {"problem": "tom has 7 apples and buys 3 boxes of 4 apples .", "answer": 19}
    assert _play(env, row, ["calc ( 3 * 4 )", "calc(7+12)", "calc ( 3 ) )", "hello",
                            "calc ( 999 * 2 )", "calc ( 2 - 5 * ( 1 ) )", "answer: 19"]) == [
        ("12", 0.0, False), ("19", 0.0, False), ("error: bad expression", 0.0, False),
        ("error: bad action", 0.0, False), ("error: too large", 0.0, False),
        ("- 3", 0.0, False), (None, 1.0, True)]
    assert _play(env, row, ["answer: 18"]) == [(None, 0.0, True)]
    assert _play(env, row, ["answer: - 19"]) == [(None, 0.0, True)]
    short = CalculatorEnvironment(max_turns=2)
    assert _play(short, row, ["calc ( 3 * 4 )", "calc ( 7 + 12 )"]) == [
        ("12", 0.0, False), (None, 0.0, True)]


def _gold_from_story(text):
    """The answer of a calculator story read off its words: the three numbers in order and the
    operations its verbs say."""
    a, b, c = (int(w) for w in text.split() if w.isdigit())
    if " buys " in text:
        return a + b * c
    if " more " in text:
        return (a + b) * c
    if " gives away " in text:
        return a * b - c
    assert " loses " in text
    return (a - b) * c


def test_calculator_demonstrations_solve_their_problems(calc_tokenizer):
    task = calculator.CalculatorTask()
    demos = calculator.demonstrations(task, seed=3, n=24)
    assert {w for d in demos for w in d["problem"].split()} >= {"buys", "more", "away", "loses"}
    env = CalculatorEnvironment(max_turns=4)
    unk = calc_tokenizer.unk_token_id
    for demo in demos:
        assert demo["answer"] == _gold_from_story(demo["problem"])
        messages = demo["messages"]
        states, prompts = env.reset([demo], [0])
        assert prompts == [messages[:1]]
        for turn in range(1, len(messages), 2):
            result = env.step(states, [messages[turn]["content"]], [[]])
            states = result.states
            last = turn == len(messages) - 1
            assert bool(result.done[0]) == last
            assert float(result.rewards[0]) == (1.0 if last else 0.0)
            assert result.observations[0] == (None if last else messages[turn + 1]["content"])
        ids = _template_ids(calc_tokenizer, messages, False)
        assert unk not in ids
        for m in messages:
            assert calc_tokenizer.decode(calc_tokenizer(m["content"])["input_ids"]) == m["content"]


def test_shortcut_demonstrations_stop_after_one_call_and_earn_nothing():
    """With `demo_shortcut` a demonstration may answer the first call's value right after it:
    two assistant turns instead of three, the same problems as without shortcuts, and the
    environment scores exactly the demonstrations that did not stop early."""
    full = calculator.demonstrations(calculator.CalculatorTask(), seed=5, n=64)
    demos = calculator.demonstrations(calculator.CalculatorTask(demo_shortcut=0.5), seed=5, n=64)
    assert 16 < sum(d["shortcut"] for d in demos) < 48 and not any(d["shortcut"] for d in full)
    env = CalculatorEnvironment(max_turns=4)
    for demo, whole in zip(demos, full):
        assert demo["problem"] == whole["problem"]
        messages = demo["messages"]
        if not demo["shortcut"]:
            assert messages == whole["messages"]
            continue
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[:3] == whole["messages"][:3]
        assert messages[3]["content"] == f"answer: {messages[2]['content']}"
        states, _ = env.reset([demo], [0])
        states = env.step(states, [messages[1]["content"]], [[]]).states
        result = env.step(states, [messages[3]["content"]], [[]])
        assert bool(result.done[0]) and float(result.rewards[0]) == 0.0
    with pytest.raises(ValueError, match="demo_shortcut"):
        calculator.CalculatorTask(demo_shortcut=1.5)


STDIN_IO = {"inputs": ["1 2\n", "3 4\n", "-5 5\n"], "outputs": ["3\n", "7\n", "0\n"]}


def test_apps_repair_rewards_sum_to_the_final_pass_rate_and_feedback_shows_failing_tests():
    env = AppsRepairEnvironment(max_attempts=3, timeout_s=2.0, feedback_cases=1)
    row = {"prompt": "\nQUESTION:\nPrint a + b.\nUse Standard Input format\nANSWER:\n",
           "input_output": json.dumps(STDIN_IO)}
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b if a > 0 else a + b)\n```"
    right = "a, b = map(int, input().split())\nprint(a + b)"
    (obs1, r1, done1), (obs2, r2, done2) = _play(env, row, [wrong, right])
    # The wrong program passes only "-5 5" (-5 + 5 = 0); it prints 1 - 2 = -1 for "1 2".
    assert obs1 == ("The program passed 1 of 3 tests. Failing tests:\ninput:\n1 2\nexpected:\n3\n"
                    "got:\n-1\n(1 more failing tests)\nFix the program.")
    assert (r1, done1) == (pytest.approx(1 / 3), False)
    assert (obs2, r2, done2) == (None, pytest.approx(2 / 3), True)


# ---- failures ------------------------------------------------------------------------------
class _Broken(CalculatorEnvironment):
    """Breaks on the rows whose answer says how: 1 raises, 2 observes an int, 3 gives a NaN
    reward, 4 answers three items."""

    def step_row(self, state, action_text, action_tokens):
        new_state, observation, reward, done = super().step_row(state, action_text,
                                                                action_tokens)
        if state.answer == 1:
            raise RuntimeError("the tool crashed")
        if state.answer == 2:
            return new_state, 12, reward, done
        if state.answer == 3:
            return new_state, observation, float("nan"), done
        if state.answer == 4:
            return new_state, observation, reward
        return new_state, observation, reward, done


@pytest.mark.parametrize("row_workers", [1, 3])
def test_a_failing_environment_flags_its_row_and_leaves_the_others_untouched(row_workers):
    env = _Broken()
    env.row_workers = row_workers
    rows = [{"problem": "p", "answer": a} for a in (12, 1, 2, 3, 4, 7)]
    states, _ = env.reset(rows, range(6))
    actions = ["calc ( 3 * 4 )"] * 5 + ["answer: 7"]
    result = env.step(states, actions, [[]] * 6)
    alone = CalculatorEnvironment().step([states[0], states[5]], [actions[0], actions[5]],
                                         [[], []])
    assert result.failed.tolist() == [False, True, True, True, True, False]
    assert result.done.tolist() == [False, True, True, True, True, True]
    assert result.observations == ["12", None, None, None, None, None]
    assert result.rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert result.rewards.dtype == np.float32
    assert [result.states[0], result.states[5]] == alone.states
    assert result.states[0].turns == 1
    assert all(result.states[i] is states[i] for i in (1, 2, 3, 4))
    assert envs.flag_counts(result.done, result.failed) == {"env/done_rows": 5,
                                                            "env/failed_rows": 4}
    with pytest.raises(ValueError, match=r"cannot start from task row 1: a calculator row needs"):
        env.reset([rows[0], {"problem": "p"}], [0, 1])


def test_unknown_environment_is_one_line_listing_the_known_ones():
    with pytest.raises(ValueError) as error:
        envs.environment("wordle")
    assert str(error.value) == ("unknown environment 'wordle': must be one of "
                                "('apps_repair', 'calculator', 'game', 'reasoning_gym')")
    with pytest.raises(ValueError, match="registered twice"):
        envs.register_environment("calculator")(CalculatorEnvironment)


def test_environments_are_called_from_outside_and_call_only_downward():
    """envs/ may call eval/'s jail and data/, never the reverse; the rollout engine, the
    estimators and the data know no environment (the engine takes a host callback)."""
    graph = import_graph()
    assert "marl_jax.eval.apps" in graph["marl_jax.envs.apps_repair"], "the drawing sees envs/"
    into_envs = [(source, target) for source, targets in graph.items()
                 if source.startswith(("marl_jax.eval", "marl_jax.data", "marl_jax.rollout",
                                       "marl_jax.macro"))
                 for target in targets if target.startswith("marl_jax.envs")]
    assert into_envs == []
    upward = [(source, target) for source, targets in graph.items()
              if source.startswith("marl_jax.envs") for target in targets
              if target.startswith(("marl_jax.train", "marl_jax.rollout", "marl_jax.pipeline"))]
    assert upward == []


# ---- the rollout's host callback ---------------------------------------------------------
def test_turn_callback_gives_the_template_tokens_of_a_transcript(calc_tokenizer):
    tok = calc_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    demo = calculator.demonstrations(calculator.CalculatorTask(), seed=5, n=1)[0]
    rows = [demo, {"problem": "p", "answer": 1}, {"problem": "q", "answer": 2}]
    prompts, step_turns = envs.turn_callback(CalculatorEnvironment(), tok, rows, [0, 1, 2],
                                             max_observation_tokens=7)
    assert prompts[1] == _template_ids(tok, [{"role": "user", "content": "p"}], True)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    # Row 1 leaves its action open (the environment closes it); row 2's observation
    # "error: too large" takes 8 tokens, over the budget of 7.
    step = step_turns([0, 1, 2], [ids(demo["messages"][1]["content"]) + [end],
                                  ids("calc ( 3 * 4 )"), ids("calc ( 999 * 2 )") + [end]])
    assert step.observation_ids[1] == [end] + ids("<|im_start|> tool 12 <|im_end|> "
                                                  "<|im_start|> assistant")
    assert step.observation_ids[2] is None
    assert step.failed.tolist() == [False, False, True]
    assert step.done.tolist() == [False, False, True]
    trajectory = prompts[0] + ids(demo["messages"][1]["content"]) + [end] + step.observation_ids[0]
    for turn in range(3, len(demo["messages"]), 2):
        action = ids(demo["messages"][turn]["content"]) + [end]
        step = step_turns([0], [action])
        trajectory += action + (step.observation_ids[0] or [])
    assert (step.rewards.tolist(), step.done.tolist()) == ([1.0], [True])
    assert trajectory == _template_ids(tok, demo["messages"], False)
    with pytest.raises(ValueError, match="row 2 is done"):
        step_turns([2], [ids("answer: 2")])
