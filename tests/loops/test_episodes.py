"""Multi-turn rollouts (loops/episodes.py) and environments (loops/envs.py): the layout, the masking
rule (the environment's tokens are context, never loss), rewards at episode end, and every online
recipe trained on episodes with its own step."""

import dataclasses

import pytest
import torch

from rlcore import keys as K
from rlcore.algorithms.policy_gradient import grpo_loss
from rlcore.loops import cli
from rlcore.loops.config import ConfigError, load_config
from rlcore.loops.envs import ENVS, EnvStep, LookupEnv, ToolEnv, calculate, resolve_env
from rlcore.loops.episodes import render_continuation, sample_episodes
from rlcore.loops.models import build_model, build_tokenizer
from rlcore.loops.online import with_policy_logprobs
from rlcore.loops.recipes import grpo, online_dpo, ppo, rloo
from rlcore.loops.score import last_turn_ids, score_rollout, sequences, token_logprobs_from_model
from tests.loops.online_helpers import TINY

ROWS = {"prompt": ["12+7=", "3*4="], "answer": ["19", "12"]}


class Countdown:
    """Answers each assistant turn with a tool message for ``turns - 1`` turns, then ends; reward 1 a turn."""

    def __init__(self, turns: int = 3):
        self.left, self.seen = turns, []

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.seen.append(text)
        self.left -= 1
        if self.left <= 0:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(messages=({"role": "tool", "content": f"{self.left} left"},), reward=1.0)


@pytest.fixture(scope="module")
def lm():
    tokenizer = build_tokenizer()
    model = build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0).eval()
    return model, tokenizer


def _one_token_turns(tokenizer):
    """Every token a stop token: each assistant turn is one token that ends it (never cut)."""
    return list(range(len(tokenizer)))


def test_episode_layout_and_the_masking_rule(lm):
    model, tokenizer = lm
    out = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), num_samples=2, max_new_tokens=4, max_turns=5,
                          stop_token_ids=_one_token_turns(tokenizer), seed=7)
    B = 4
    assert out.batch_size == torch.Size([B])
    own, real = out[K.RESPONSE_MASK], out[K.TRAJECTORY_MASK]
    assert bool((own <= real).all())  # the model's tokens are part of the trajectory
    assert torch.equal(out[K.TURNS], torch.full((B,), 3)) and torch.equal(out[K.ENV_REWARD], torch.full((B,), 3.0))
    assert not out[K.TRUNCATED].any()
    assert torch.equal(own.sum(-1), torch.full((B,), 3))  # three one-token assistant turns
    assert torch.equal(out[K.GROUP_ID], torch.tensor([0, 0, 1, 1]))
    # old log-probs only on the model's tokens
    assert bool((out[K.OLD_LOGPROBS][~own] == 0).all())
    # the environment's tokens are exactly the chat template's continuation after each turn
    row = out[0]
    env_ids = row[K.RESPONSE_IDS][real[0] & ~own[0]].tolist()
    turns = row[K.TURN_IDS][real[0]].tolist()
    model_tokens = row[K.RESPONSE_IDS][own[0]].tolist()
    expected = []
    for i, token in enumerate(model_tokens[:2]):  # after each turn but the last: the closing, the tool, the prompt
        new = [{"role": "tool", "content": f"{2 - i} left"}]
        expected += tokenizer(render_continuation(tokenizer, new, None, tokenizer.decode([token])),
                              add_special_tokens=False)["input_ids"]
    assert env_ids == expected
    assert turns == sorted(turns) and set(turns) == {0, 1, 2}
    # the whole trajectory reads as the chat template renders the finished conversation
    conversation = [{"role": "user", "content": "12+7="}]
    for i, token in enumerate(model_tokens):
        conversation.append({"role": "assistant", "content": tokenizer.decode([token], skip_special_tokens=True)})
        if i < 2:
            conversation.append({"role": "tool", "content": f"{2 - i} left"})
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    whole = tokenizer.decode(row[K.PROMPT_IDS][row[K.PROMPT_MASK]].tolist() + row[K.RESPONSE_IDS][real[0]].tolist())
    assert rendered.startswith(whole.removesuffix("</s>")) or whole.startswith(rendered.removesuffix("</s>"))


def test_the_behaviour_logprobs_are_those_of_one_forward_over_the_whole_trajectory(lm):
    """Recomputed in one forward with the environment's tokens in the context (``sequences``: the
    trajectory mask), the model tokens' log-probs equal those recorded turn by turn."""
    model, tokenizer = lm
    out = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), max_new_tokens=3, max_turns=3,
                          stop_token_ids=_one_token_turns(tokenizer), seed=3)
    ids, mask = sequences(out)
    assert torch.equal(mask[:, ids.shape[1] - out[K.RESPONSE_IDS].shape[1]:], out[K.TRAJECTORY_MASK])
    with torch.no_grad():
        lp = token_logprobs_from_model(model, ids, mask, response_length=out[K.RESPONSE_IDS].shape[1])
    own = out[K.RESPONSE_MASK]
    torch.testing.assert_close(lp[own], out[K.OLD_LOGPROBS][own], rtol=1e-4, atol=1e-4)


def test_the_same_seed_plays_the_same_episodes_and_the_caller_rng_is_untouched(lm):
    model, tokenizer = lm
    kw = dict(num_samples=2, max_new_tokens=3, max_turns=3, stop_token_ids=_one_token_turns(tokenizer), seed=11)
    before = torch.random.get_rng_state()
    a = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), **kw)
    b = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), **kw)
    assert torch.equal(torch.random.get_rng_state(), before)
    for key in a.keys():
        assert torch.equal(a[key], b[key]), key


def test_budgets_end_episodes_as_truncated(lm):
    model, tokenizer = lm
    stops = _one_token_turns(tokenizer)
    capped = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(10), max_new_tokens=3, max_turns=10,
                             max_episode_tokens=12, stop_token_ids=stops, seed=1)
    assert bool((capped[K.TRAJECTORY_MASK].sum(-1) <= 12).all()) and bool(capped[K.TRUNCATED].all())
    short = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(10), max_new_tokens=3, max_turns=2,
                            stop_token_ids=stops, seed=1)
    assert torch.equal(short[K.TURNS], torch.full((2,), 2)) and not short[K.TRUNCATED].any()
    # a turn cut at max_new_tokens (no stop token) ends its episode, truncated
    cut = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(10), max_new_tokens=2, max_turns=4,
                          stop_token_ids=(), seed=1)
    ended = ~cut[K.TRUNCATED]
    assert bool((cut[K.TURNS][cut[K.TRUNCATED]] >= 1).all()) and bool((cut[K.TURNS] <= 4).all())
    assert ended.sum() + cut[K.TRUNCATED].sum() == 2


def test_an_environment_that_raises_stops_the_run_naming_it(lm):
    model, tokenizer = lm

    class Broken(Countdown):
        def step(self, text):
            raise KeyError("boom")

    with pytest.raises(RuntimeError, match=r"env: Broken.step raised KeyError"):
        sample_episodes(model, tokenizer, ROWS, Broken, max_new_tokens=2, max_turns=2,
                        stop_token_ids=_one_token_turns(tokenizer), seed=0)


def test_rewards_at_episode_end_and_the_answer_is_the_last_turn(lm):
    model, tokenizer = lm
    out = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(2), max_new_tokens=3, max_turns=3,
                          stop_token_ids=_one_token_turns(tokenizer), seed=5)
    seen = {}

    def reward(prompts, completions, completion_ids, trajectories, **_):
        seen.update(completions=completions, ids=completion_ids, trajectories=trajectories)
        return [0.5] * len(completions)

    scored = score_rollout(out, reward_fn=reward, tokenizer=tokenizer, prompts=list(ROWS["prompt"]))
    torch.testing.assert_close(scored[K.SCORE], out[K.ENV_REWARD] + 0.5)
    assert torch.equal(scored[K.REWARD_TERMS]["env"], out[K.ENV_REWARD])
    assert seen["ids"] == last_turn_ids(out) and all(len(ids) == 1 for ids in seen["ids"])
    assert all("1 left" in t for t in seen["trajectories"])  # the whole episode, the tool's turn included


def test_the_loss_and_kl_never_see_the_environments_tokens(lm):
    """Changing the log-probs (behaviour, reference) at the environment's positions changes neither the
    loss nor its gradient: those tokens are context, not actions."""
    model, tokenizer = lm
    out = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), num_samples=2, max_new_tokens=3, max_turns=3,
                          stop_token_ids=_one_token_turns(tokenizer), seed=2)
    env = out[K.TRAJECTORY_MASK] & ~out[K.RESPONSE_MASK]
    assert env.any()
    batch = out.copy().update({K.ADVANTAGES: torch.linspace(-1, 1, 4)[:, None].expand_as(out[K.OLD_LOGPROBS]),
                               K.REF_LOGPROBS: out[K.OLD_LOGPROBS] - 0.1})
    noisy = batch.copy().update({K.OLD_LOGPROBS: torch.where(env, -50.0, batch[K.OLD_LOGPROBS]),
                                 K.REF_LOGPROBS: torch.where(env, 9.0, batch[K.REF_LOGPROBS])})
    grads = []
    for b in (batch, noisy):
        model.zero_grad(set_to_none=True)
        loss, metrics = grpo_loss(with_policy_logprobs(model, b, with_entropy=True), kl_coef=0.1)
        loss.backward()
        grads.append((loss.detach(), float(metrics["entropy"]), [p.grad.clone() for p in model.parameters()]))
    (l0, e0, g0), (l1, e1, g1) = grads
    assert torch.equal(l0, l1) and e0 == e1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    model.zero_grad(set_to_none=True)


# --- environments --------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression,result", [("12+7", "19"), ("7*36", "252"), ("(3+4)*2", "14"), ("7/2", "3.5"),
                                               ("8/2", "4"), ("-3**2", "-9"), ("2**10", "1024"), ("17//5", "3"),
                                               ("17 % 5", "2"), ("0.1+0.2", "0.3"), ("1/3", "1/3"), ("-7/4", "-1.75"),
                                               ("10**23/1", "1" + "0" * 23), ("12345678901234567*3/3",
                                                                             "12345678901234567"), ("2**-2", "0.25"),
                                               ("-" * 190 + "1", "1"), ("(" * 99 + "1" + ")" * 99, "1")])
def test_calculate(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression", ["1/0", "__import__('os')", "a+1", "(1).real", "2**10000", "9" * 300,
                                        "[1, 2]", "1 if 1 else 2", "10**6**6", "9**9**9", "2**0.5", "(-8)**0.5",
                                        "1e308*10", "1e400", "True+1"])
def test_calculate_answers_anything_with_an_error_and_runs_no_code(expression):
    assert calculate(expression).startswith("error:")


def test_the_tool_env_runs_calls_and_ends_on_a_turn_without_one():
    env = ENVS["calculator"]()
    opening = env.reset({"prompt": "12+7="})
    assert opening[0]["role"] == "system" and opening[-1] == {"role": "user", "content": "12+7="}
    step = env.step('<tool_call>\n{"name": "calculate", "arguments": {"expression": "12+7"}}\n</tool_call>')
    assert step.messages == ({"role": "tool", "content": "19"},) and not step.done
    bad = env.step("<tool_call>{not json</tool_call>")
    assert bad.messages[0]["content"].startswith("error:") and not bad.done  # the model reads its mistake
    assert env.step("19").done
    assert env.schemas()[0]["function"]["name"] == "calculate"


def test_the_lookup_env_reads_the_rows_facts():
    env = LookupEnv({"sky": "blue"})
    env.reset({"prompt": "capital of X?", "facts": {"X": "Y"}})
    assert env.step('<tool_call>{"name": "lookup", "arguments": {"key": "X"}}</tool_call>').messages[0]["content"] == "Y"
    env.reset({"prompt": "colour of the sky?"})
    assert env.step('<tool_call>{"name": "lookup", "arguments": {"key": "sky"}}</tool_call>').messages[0][
        "content"] == "blue"


def _double(x: int) -> int:
    """Double a number.

    Args:
        x: the number.
    """
    return 2 * x


def test_resolve_env():
    assert resolve_env(None) is None
    assert resolve_env("calculator").func is ENVS["calculator"]
    assert isinstance(resolve_env(None, [_double])(), ToolEnv)
    assert isinstance(resolve_env(None, ["tests.loops.test_episodes:_double"])(), ToolEnv)
    with pytest.raises(ValueError, match="env: expected one of"):
        resolve_env("nope")
    with pytest.raises(ValueError, match="give tools or an env, not both"):
        resolve_env("calculator", [_double])
    with pytest.raises(ValueError, match="tools: cannot load"):
        resolve_env(None, ["tests.loops.test_episodes:missing"])


def test_config_checks_the_environment_at_load():
    with pytest.raises(ConfigError, match="env: expected one of"):
        load_config(grpo.Config, None, {"env": "nope", "run_dir": None})
    with pytest.raises(ConfigError, match="length_sampler: not with an environment"):
        load_config(grpo.Config, None, {"env": "calculator", "length_sampler": [2, 4], "run_dir": None})
    with pytest.raises(ConfigError, match="tool_format: expected one of"):
        load_config(grpo.Config, None, {"env": "calculator", "tool_format": "xml", "run_dir": None})
    assert load_config(grpo.Config, None, {"env": "calculator", "run_dir": None}).max_turns == 4


# --- every online recipe trains on episodes with its own step -------------------------------------------
@pytest.mark.parametrize("recipe", [grpo, rloo, ppo, online_dpo])
def test_every_online_recipe_trains_on_episodes(recipe, lm):
    _, tokenizer = lm
    samples = {} if recipe is ppo else {"num_samples": 2}
    config = recipe.Config(**{**TINY, "num_train": 8, "num_eval": 2, "max_new_tokens": 3}, **samples, batch_size=2,
                           steps=2, max_turns=3, stop_token_ids=tuple(range(len(tokenizer))))
    envs = []

    def factory():
        envs.append(Countdown(2))
        return envs[-1]

    state, history = recipe.train(config, env=factory, reward_fn=lambda completions, **_: [1.0] * len(completions))
    assert state.optimizer_steps >= 1 or recipe is online_dpo
    assert all(h["rollout/turns"] == 2.0 for h in history) and all(h["rollout/env_tokens"] > 0 for h in history)
    assert state.env is factory and envs and all(len(e.seen) == 2 for e in envs)


def test_the_cli_trains_with_a_built_in_environment(tmp_path):
    assert cli.main(["train", "grpo", "--env", "calculator", "--max_turns", "2", "--steps", "1", "--batch_size", "2",
                     "--num_samples", "2", "--hidden_size", "16", "--num_layers", "1", "--num_heads", "2",
                     "--num_train", "4", "--num_eval", "2", "--max_new_tokens", "4",
                     "--run_dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_resume_with_an_environment_is_exact(tmp_path, lm):
    _, tokenizer = lm
    config = grpo.Config(**{**TINY, "num_train": 8, "num_eval": 2, "max_new_tokens": 3, "run_dir": str(tmp_path / "a")},
                         num_samples=2, batch_size=2, steps=2, max_turns=3, save_every=1,
                         stop_token_ids=tuple(range(len(tokenizer))))
    straight, history = grpo.train(config, env=lambda: Countdown(3))
    assert history[-1]["rollout/env_tokens"] > 0
    grpo.train(dataclasses.replace(config, run_dir=str(tmp_path / "b"), steps=1), env=lambda: Countdown(3))
    resumed, _ = grpo.train(dataclasses.replace(config, run_dir=str(tmp_path / "b"), resume=True),
                            env=lambda: Countdown(3))
    for a, b in zip(straight.model("policy").parameters(), resumed.model("policy").parameters()):
        assert torch.equal(a, b)
    assert torch.equal(straight.rng.get_state(), resumed.rng.get_state())


def countdown3():
    """A module-level factory (``tests.loops.test_episodes:countdown3``): a spawned generator process resolves it."""
    return Countdown(3)


def test_no_lag_async_plays_the_synchronous_episodes(lm):
    """N = 0: the generator process plays the episodes the synchronous step plays (same seeds, same
    environment resolved from the config), so parameters, generator state and metrics agree bit for bit."""
    from rlcore.loops.scale.async_rl import train_async

    _, tokenizer = lm
    config = grpo.Config(**{**TINY, "num_train": 8, "num_eval": 2, "max_new_tokens": 3}, num_samples=2, batch_size=2,
                         steps=2, max_turns=3, env="tests.loops.test_episodes:countdown3",
                         stop_token_ids=tuple(range(len(tokenizer))), log_every=0)
    sync, sync_hist = grpo.train(config)
    state, hist = train_async(config, max_lag=0, start_method="spawn")
    for a, b in zip(sync.model("policy").parameters(), state.model("policy").parameters()):
        assert torch.equal(a, b)
    assert torch.equal(sync.rng.get_state(), state.rng.get_state())
    assert [{k: v for k, v in h.items() if not k.startswith("async/")} for h in hist] == sync_hist
    assert all(h["rollout/turns"] == 3.0 for h in hist)


def test_ray_placement_at_no_lag_plays_the_synchronous_episodes(lm):
    """The Ray generator actor resolves the config's environment and plays the episodes the
    synchronous step plays; the scorer adds the environment's rewards: parameters and metrics agree
    bit for bit at ``max_lag = 0`` (one thread everywhere, as the sync reference)."""
    ray = pytest.importorskip("ray")
    from rlcore.loops.scale.placement import train_placed

    _, tokenizer = lm
    config = grpo.Config(**{**TINY, "num_train": 8, "num_eval": 2, "max_new_tokens": 3}, num_samples=2, batch_size=2,
                         steps=2, max_turns=3, env="tests.loops.test_episodes:countdown3",
                         stop_token_ids=tuple(range(len(tokenizer))), log_every=0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        sync, sync_hist = grpo.train(config)
        state, hist = train_placed(config, max_lag=0, threads=1)
    finally:
        ray.shutdown()
        torch.set_num_threads(before)
    for a, b in zip(sync.model("policy").parameters(), state.model("policy").parameters()):
        assert torch.equal(a, b)
    assert torch.equal(sync.rng.get_state(), state.rng.get_state())
    placed = [{k: v for k, v in h.items() if k in s} for h, s in zip(hist, sync_hist)]
    assert placed == sync_hist
    assert all(h["rollout/turns"] == 3.0 for h in hist)


def test_online_dpo_pairs_attend_to_the_environments_tokens(lm):
    from rlcore.algorithms.online import online_preference_batch

    model, tokenizer = lm
    out = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(3), num_samples=2, max_new_tokens=3, max_turns=3,
                          stop_token_ids=_one_token_turns(tokenizer), seed=4)
    out[K.SCORE] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    pairs = online_preference_batch(out, num_groups=2)
    chosen = out[torch.tensor([0, 3])]
    attention = torch.cat([chosen[K.PROMPT_MASK], chosen[K.TRAJECTORY_MASK]], -1)
    assert torch.equal(pairs[K.CHOSEN, K.ATTENTION_MASK], attention)
    width = chosen[K.PROMPT_MASK].shape[-1]
    assert torch.equal(pairs[K.CHOSEN, K.LOSS_MASK][:, width:], chosen[K.RESPONSE_MASK])


def test_evaluation_plays_the_configs_environment_and_grades_the_answer_alone(lm):
    """Without ``state.env`` (``rlcore eval``) evaluation resolves the config's environment; exact
    match leaves the environment's reward out."""
    from rlcore.loops.evaluate import evaluate_policy
    from rlcore.loops.online import build_online_state

    _, tokenizer = lm

    class Generous(Countdown):
        def final_reward(self):
            return 1.0

    import sys
    import types
    module = types.ModuleType("generous_env")
    module.make = lambda: Generous(2)
    sys.modules["generous_env"] = module
    try:
        config = grpo.Config(**{**TINY, "num_train": 8, "num_eval": 4, "max_new_tokens": 2}, num_samples=2,
                             max_turns=2, env="generous_env:make", stop_token_ids=tuple(range(len(tokenizer))))
        state, tok = build_online_state(config)
        assert state.env is None
        metrics = evaluate_policy(state, config, tokenizer=tok, reward_fn=lambda completions, **_: [0.0] *
                                  len(completions))
    finally:
        del sys.modules["generous_env"]
    assert metrics["reward"] == pytest.approx(3.0)  # one per turn, two turns, and the final one
    assert metrics["exact_match"] == 0.0


def test_a_reward_function_may_require_trajectories():
    from rlcore.loops.reward_fns import reward_columns

    def judge(completions, trajectories):
        return [float("19" in t) for t in trajectories]

    assert reward_columns(judge) == ()


def test_single_turn_settings_are_refused_beside_an_environment():
    for name, value in (("missing_eos_penalty", 1.0), ("overlong_buffer", 2), ("generation_batch_size", 4)):
        with pytest.raises(ConfigError, match=f"{name}: not with an environment"):
            load_config(grpo.Config, None, {"env": "calculator", name: value, "run_dir": None})


def test_the_tool_format_reaches_the_built_ins():
    for name in ENVS:
        assert resolve_env(name, tool_format="llama3")().format == "llama3"


def test_lookup_facts_stay_with_their_row():
    env = LookupEnv({"sky": "blue"})
    env.reset({"prompt": "?", "facts": {"X": "Y", "Z": None}})  # a datasets struct column pads with None
    answer = env.step('<tool_call>{"name": "lookup", "arguments": {"key": "Z"}}</tool_call>').messages[0]["content"]
    assert answer.startswith("error: no fact 'Z'") and "'sky'" not in answer
    env.reset({"prompt": "?", "facts": {}})  # a row with no facts has none
    assert env.step('<tool_call>{"name": "lookup", "arguments": {"key": "sky"}}</tool_call>').messages[0][
        "content"].startswith("error")


def test_tools_import_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mytools_here.py").write_text(
        'def double(x: int) -> int:\n    """Double a number.\n\n    Args:\n        x: the number.\n    """\n'
        '    return 2 * x\n')
    monkeypatch.chdir(tmp_path)
    env = resolve_env(None, ["mytools_here:double"])()
    assert env.step('<tool_call>{"name": "double", "arguments": {"x": 4}}</tool_call>').messages[0]["content"] == "8"


def test_an_opening_with_no_room_left_is_an_error(lm):
    model, tokenizer = lm
    rows = {"prompt": ["9" * model.config.max_position_embeddings]}
    with pytest.raises(ValueError, match=r"episode 0 \(row 0\): its opening has \d+ tokens"):
        sample_episodes(model, tokenizer, rows, lambda: Countdown(2), max_new_tokens=4, seed=0)


def test_reset_errors_name_the_environment(lm):
    model, tokenizer = lm

    class NoReset(Countdown):
        def reset(self, row):
            raise KeyError("facts")

    with pytest.raises(RuntimeError, match=r"env: NoReset.reset raised KeyError"):
        sample_episodes(model, tokenizer, ROWS, NoReset, max_new_tokens=2, seed=0)


@pytest.mark.parametrize("name", ["reft_grpo", "reft_rloo"])
def test_the_reft_recipes_refuse_an_environment(name):
    from rlcore.loops.recipes import RECIPES

    with pytest.raises(ValueError, match="env: a ReFT policy intervenes at its prompt's positions"):
        RECIPES[name].config(env="calculator", run_dir=None)


def _local_attention_lm(tokenizer):
    """GPT-Neo with a local attention window of 8 columns: its attention depends on where a row's
    tokens sit in the batch, not only on their positions."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GPTNeoConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_layers=4, num_heads=4, attention_types=[[["local", "global"], 2]],
        window_size=8, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)).eval()


@pytest.mark.parametrize("arch,do_sample,every", [("llama", False, 2), ("llama", True, 3), ("llama", True, 4),
                                                  ("gpt_neo", True, 3)])
def test_a_kept_context_plays_the_episodes_of_a_whole_prefill_each_turn(arch, do_sample, every):
    """The loop engine's per-episode KV cache (``ContextCache``): each turn reads only what is new,
    and the episodes (ragged turns: some rows stop early, some run to the budget) are those of
    encoding every turn's whole context again, to float rounding (the tokens exactly here), also for
    a model with a local attention window."""
    tokenizer = build_tokenizer()
    model = build_model("llama", tokenizer=tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=3).eval() \
        if arch == "llama" else _local_attention_lm(tokenizer)
    stops = list(range(0, len(tokenizer), every))
    read = []

    def count(module, args, kwargs):
        width = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]
        if width > 1:  # a prefill, not a decode step
            read.append(width)
    hook = model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    kw = dict(num_samples=3, max_new_tokens=6, max_turns=4, stop_token_ids=stops, seed=5, do_sample=do_sample)
    try:
        kept = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(4), **kw)
        read_kept, read[:] = list(read), []
        whole = sample_episodes(model, tokenizer, ROWS, lambda: Countdown(4), reuse_context=False, **kw)
    finally:
        hook.remove()
    assert int(kept[K.TURNS].sum()) > len(kept)
    assert not do_sample or len(set(kept[K.RESPONSE_MASK].sum(-1).tolist())) > 1  # ragged turns
    for key in kept.keys():
        if key != K.OLD_LOGPROBS:
            assert torch.equal(kept[key], whole[key]), key
    torch.testing.assert_close(kept[K.OLD_LOGPROBS], whole[K.OLD_LOGPROBS], rtol=1e-5, atol=1e-5)
    assert sum(read_kept) < sum(read) / 2  # the prefills read the new tokens only


def test_a_context_cache_reads_only_what_follows_its_tokens_and_refuses_what_it_cannot_carry(lm):
    from rlcore.loops.engines import ContextCache, carries_context, sample_responses

    model, tokenizer = lm
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = ids != 0
    caches = [ContextCache(), ContextCache()]
    kw = dict(max_new_tokens=3, stop_token_ids=[], pad_token_id=0, sampler=None)
    first = sample_responses(model, ids, mask, past=caches, **kw)[0]
    assert [c.ids for c in caches] == [[5, 6, 7, 8] + first[0, :2].tolist(), [9, 10] + first[1, :2].tolist()]
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert all(k.shape == v.shape == (heads, len(c), dim) for c in caches for k, v in c.layers)
    # a row that does not start with its cache's tokens is read whole; the others continue
    nxt = torch.cat([torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), first], -1)
    again = sample_responses(model, nxt, nxt != 0, past=caches, **kw)[0]
    assert torch.equal(again, sample_responses(model, nxt, nxt != 0, **kw)[0])
    with pytest.raises(ValueError, match="one ContextCache per prompt"):
        sample_responses(model, ids, mask, past=caches[:1], **kw)
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=2, sliding_window=4))
    assert carries_context(model) and not carries_context(windowed)
    with pytest.raises(ValueError, match="sliding-window"):
        sample_responses(windowed, ids, mask, past=caches, **kw)
