"""workers: the four dispatchable operations equal the pieces they wrap and never write into a batch."""

import pytest
import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.models import build_model, build_value_model
from rlcore.loops.score import score_rollout
from rlcore.loops.state import init_state
from rlcore.loops.update import chain, clip_by_global_norm, skip_nonfinite, update
from rlcore.loops.scale.workers import WORKER_OPS, compute_log_probs, compute_rewards, compute_values, train_step
from rlcore.masked import aggregate
from rlcore.testing import assert_pure, make_rollout

V = 40


def lm(seed=0):
    return build_model("llama", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, seed=seed)


@pytest.fixture(scope="module")
def state():
    policy = lm(0)
    return init_state({"policy": policy, "ref": lm(1), "value": build_value_model(vocab_size=V, hidden_size=16,
                                                                                    num_layers=1, num_heads=2)},
                      optimizer=torch.optim.SGD(policy.parameters(), lr=0.1), seed=0)


def rollout():
    return make_rollout(4, 5, 3, vocab_size=V, generator=torch.Generator().manual_seed(2)).exclude(
        K.OLD_LOGPROBS, K.REF_LOGPROBS, K.VALUES, K.SCORE)


def test_compute_log_probs_policy_and_reference(state):
    batch = rollout()
    s, out = assert_pure(compute_log_probs, state, batch)
    assert s is state
    torch.testing.assert_close(out[K.OLD_LOGPROBS], score_rollout(batch, policy=state.model())[K.OLD_LOGPROBS])
    _, ref = compute_log_probs(state, batch, model="ref")
    torch.testing.assert_close(ref[K.REF_LOGPROBS], score_rollout(batch, ref=state.model("ref"))[K.REF_LOGPROBS])
    assert K.OLD_LOGPROBS not in ref.keys() and not torch.equal(ref[K.REF_LOGPROBS], out[K.OLD_LOGPROBS])
    with pytest.raises(KeyError, match="model 'critic' is not in the state"):
        compute_log_probs(state, batch, model="critic")


def test_compute_values_reads_the_state_before_each_token(state):
    batch = rollout()
    _, out = compute_values(state, batch)
    ids = torch.cat([batch[K.PROMPT_IDS], batch[K.RESPONSE_IDS]], -1)
    mask = torch.cat([batch[K.PROMPT_MASK], batch[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        full = state.model("value")(input_ids=ids, attention_mask=mask.long(),
                                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[..., 0]
    P = batch[K.PROMPT_IDS].shape[1]
    expected = torch.where(batch[K.RESPONSE_MASK], full[:, P - 1:-1], 0.0)
    torch.testing.assert_close(out[K.VALUES], expected, rtol=1e-5, atol=1e-6)


def test_compute_rewards_with_a_function_and_errors(state):
    batch = rollout()

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x" * len(i) for i in ids]

    fn = lambda prompts, completions, bonus: [len(c) + b for c, b in zip(completions, bonus)]  # noqa: E731
    _, out = compute_rewards(state, batch, reward_fn=fn, tokenizer=Tok(), reward_columns={"bonus": [0, 1, 2, 3]})
    expected = batch[K.RESPONSE_MASK].sum(-1).float() + torch.arange(4.0)
    torch.testing.assert_close(out[K.SCORE], expected)
    with pytest.raises(ValueError, match=r"no reward model 'reward' in the state \(it has \['policy', 'ref', 'value'\]"):
        compute_rewards(state, batch)


def test_train_step_is_update():
    def loss_fn(st, mb, **d):
        ids = torch.cat([mb[K.PROMPT_IDS], mb[K.RESPONSE_IDS]], -1)
        logits = st.model()(ids).logits[:, mb[K.PROMPT_IDS].shape[1] - 1:-1].log_softmax(-1)
        lp = logits.gather(-1, mb[K.RESPONSE_IDS][..., None])[..., 0]
        return aggregate(-lp, mb[K.RESPONSE_MASK], "token_mean", **d), TensorDict({}, [])

    batch, kw = rollout(), {"mask_key": K.RESPONSE_MASK, "micro_batch_size": 2,
                            "transform": chain(skip_nonfinite(), clip_by_global_norm(1.0))}
    a, b = lm(0), lm(0)
    sa = init_state(a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1), seed=0)
    sb = init_state(b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1), seed=0)
    new, metrics = train_step(sa, batch, loss_fn=loss_fn, **kw)
    _, expected = update(sb, batch, loss_fn, **kw)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert float(metrics["loss"]) == float(expected["loss"]) and new.optimizer_steps == 1
    assert any((p - q).abs().max() > 0 for p, q in zip(a.parameters(), lm(0).parameters()))  # it trained


def test_registry_has_the_four_operations():
    assert sorted(WORKER_OPS) == ["compute_log_probs", "compute_rewards", "compute_values", "train_step"]
