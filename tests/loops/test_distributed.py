"""Data parallelism on CPU: 2 gloo ranks × b rows give the parameters of 1 process × 2b rows.

One module-scoped fixture spawns the two ranks once (``rlcore.loops.dist.spawn``, a free port)
and runs every distributed scenario in them; each rank writes what it saw to a temporary
directory and the tests below compare it with one process on the concatenated batch. Tolerance
for float64 parameters: 1e-10 (observed differences are float summation order, ~1e-16).
"""

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.policy_gradient import grpo_loss
from rlcore.loops.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rlcore.loops.dist.sync import (accumulation_context, all_ranks_ok, drop_tied, full_optimizer_state,
                                          full_weights, grad_sync, reduce_gradients, shard_optimizer_state,
                                          total_grad_norm)
from rlcore.loops.dist import (STRATEGIES, DistInfo, agree, dist_info, init_distributed, is_main,
                                            reduce_metrics, shard_batch, shard_source, unwrap_model, wrap_model)
from rlcore.loops.recipes import ppo
from rlcore.loops.fold import fold
from rlcore.loops.models import build_model
from rlcore.loops.online import with_policy_logprobs
from rlcore.loops.state import init_state
from rlcore.loops.collate import row_tokens
from rlcore.loops.update import chain, clip_by_global_norm, global_denominators, skip_nonfinite, stop_on, update
from rlcore.masked import aggregate
from rlcore.testing import MockLM, make_rollout
from rlcore.transforms import running_moments_init
from tests.loops.conftest import run_ranks, write_rank

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
MODES = ("token_mean", "seq_mean_token_mean")
WRAPS = (None, "bucketed", "ddp", "fsdp2")
B = 8  # global rows: 4 per rank


# --- shared by the ranks and the single-process references ----------------------------------------
def global_batch(rows=B, seed=1):
    return make_rollout(rows, 6, 4, dtype=DT, empty_rows=1, generator=torch.Generator().manual_seed(seed))


def response_logprobs(model, mb):
    ids = torch.cat([mb[K.PROMPT_IDS], mb[K.RESPONSE_IDS]], -1)
    attn = torch.cat([mb[K.PROMPT_MASK], mb[K.RESPONSE_MASK]], -1)
    logits = model(ids, attn).logits[:, mb[K.PROMPT_IDS].shape[1] - 1:-1]
    return logits.log_softmax(-1).gather(-1, mb[K.RESPONSE_IDS][..., None])[..., 0]


def make_loss(mode):
    def loss_fn(state, mb, **denominators):
        lp = response_logprobs(state.model(), mb)
        loss = aggregate(-lp, mb[K.RESPONSE_MASK], mode, **denominators)
        return loss, TensorDict({"loss_nll": loss.detach(), "mean_lp": lp.detach().mean()}, [])
    return loss_fn


def row_mean_loss(state, mb):
    lp = response_logprobs(state.model(), mb)
    per_row = torch.where(mb[K.RESPONSE_MASK], -lp, 0.0).sum(-1)
    return per_row.mean(), {"loss_rows": per_row.mean().detach()}


def model_state(strategy=None, *, adam=False):
    model = wrap_model(MockLM(seed=0).to(DT), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if adam else torch.optim.SGD(model.parameters(), lr=0.5)
    return init_state(model, optimizer=opt, seed=3)


def recipe_batch(rows=B):
    """A rollout for a tiny Llama (vocabulary 103) with GRPO advantages."""
    g = torch.Generator().manual_seed(5)
    batch = make_rollout(rows, 5, 3, vocab_size=103, dtype=DT, group_size=2, generator=g)
    return batch.update({K.ADVANTAGES: torch.randn(rows, 5, generator=g, dtype=DT)})


def recipe_state():
    """The online recipes' setting: an unwrapped Hugging Face policy (strategy None)."""
    policy = build_model("llama", vocab_size=103, hidden_size=16, num_layers=1, num_heads=2, dtype=DT)
    return init_state(wrap_model(policy, strategy=None), optimizer=torch.optim.SGD(policy.parameters(), lr=0.5),
                      seed=3)


def RECIPE_LOSS(state, batch, **denominators):
    """The online recipes' loss closure: log-probs through the chunked trunk -> head path, then the loss."""
    return grpo_loss(with_policy_logprobs(state.model("policy"), batch), **denominators)


def flat(model):
    """Every parameter as one float64 vector (FSDP2 shards gathered: a collective)."""
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in unwrap_model(model).parameters()]
    return torch.cat([p.detach().reshape(-1).to(DT) for p in ps])


def floats(metrics):
    return {k: float(v) for k, v in metrics.items()}


# --- what each rank runs -------------------------------------------------------------------------------
def _equivalence(out, tensors):
    local = shard_batch(global_batch())
    for mode in MODES:
        for strategy in WRAPS:
            state = model_state(strategy)
            new, metrics = update(state, local, make_loss(mode), micro_batch_size=2, mask_key=K.RESPONSE_MASK,
                                  transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
            tensors[f"{mode}/{strategy}"] = flat(new.model())
            out[f"{mode}/{strategy}"] = floats(metrics)
    for strategy in WRAPS:  # micro-batches by a token budget: the ranks' counts differ (FSDP2 evens them)
        budget = dict(max_tokens_per_micro_batch=9, row_tokens=functools.partial(row_tokens, packed=True))
        new, _ = update(model_state(strategy), local, make_loss("token_mean"), mask_key=K.RESPONSE_MASK, **budget,
                        transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
        tensors[f"budget/{strategy}"] = flat(new.model())
    new, metrics = update(recipe_state(), shard_batch(recipe_batch()), RECIPE_LOSS, micro_batch_size=2,
                          mask_key=K.RESPONSE_MASK)
    tensors["recipe"], out["recipe"] = flat(new.model()), floats(metrics)
    rows = shard_batch(global_batch(7))  # 4 + 3 rows, per-row mean loss, no mask_key
    new, metrics = update(model_state(), rows, row_mean_loss, micro_batch_size=3, transform=chain(skip_nonfinite()))
    tensors["rows"], out["rows"] = flat(new.model()), floats(metrics)
    rank, seven = dist_info().rank, global_batch(7)
    for strategy in WRAPS:  # 6 rows and 1: FSDP2's rank 1 runs its row in 3 forwards, 2 of them at weight 0
        new, _ = update(model_state(strategy), seven[1:] if rank == 0 else seven[:1], row_mean_loss,
                        micro_batch_size=2 if rank == 0 else 1, transform=chain(skip_nonfinite()))
        tensors[f"uneven/{strategy}"] = flat(new.model())
        # rank 1's rows not counted: the step of rank 0's 4 rows alone (denominators too)
        new, metrics = update(model_state(strategy), seven[:4] if rank == 0 else seven[4:], make_loss("token_mean"),
                              mask_key=K.RESPONSE_MASK, micro_batch_size=2, counted=rank == 0,
                              transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
        tensors[f"uncounted/{strategy}"], out[f"uncounted/{strategy}"] = flat(new.model()), floats(metrics)
    out["local_tokens"] = int(local[K.RESPONSE_MASK].sum())
    out["denominators"] = {k: int(v) for k, v in global_denominators(local, K.RESPONSE_MASK).items()}


def _overlap(out, tensors):
    """``bucketed`` sends buckets during the backward (buckets of 256 bytes here: about one per parameter);
    a parameter reached twice (a reentrant checkpoint's inner backward, then the outer one) after its
    bucket was sent makes the step reduce again."""
    from rlcore.loops.dist import sync

    seen = []
    finish = sync.OverlappedReduction.finish

    def recorded(self):
        finish(self)
        seen.append([self.sent_in_backward, len(self.buckets), self.late])

    local = shard_batch(global_batch())

    def reentrant(state, mb, **d):
        loss, m = make_loss("token_mean")(state, mb, **d)
        last = list(state.model().parameters())[-1]  # the first bucket, sent as soon as its gradient is made
        x = torch.ones_like(last, requires_grad=True)
        again = torch.utils.checkpoint.checkpoint(lambda x: (last * x).square().sum(), x, use_reentrant=True)
        return loss + 0.1 * again, m

    sync.OverlappedReduction.finish = recorded
    try:
        for strategy in (None, "bucketed"):  # the first bucket's parameter frozen: no gradient to wait for
            seen.clear()
            state = model_state(strategy)
            list(state.model().parameters())[-1].requires_grad_(False)
            new, _ = update(state, local, make_loss("token_mean"), micro_batch_size=2, mask_key=K.RESPONSE_MASK)
            tensors[f"frozen/{strategy}"], out[f"frozen/sent/{strategy}"] = flat(new.model()), list(seen)
        for strategy in (None, "bucketed"):
            seen.clear()
            new, _ = update(model_state(strategy), local, make_loss("token_mean"), micro_batch_size=2,
                            mask_key=K.RESPONSE_MASK)
            out[f"overlap/sent/{strategy}"] = list(seen)
            seen.clear()
            new, _ = update(model_state(strategy), local, reentrant, micro_batch_size=2, mask_key=K.RESPONSE_MASK)
            tensors[f"late/{strategy}"], out[f"late/seen/{strategy}"] = flat(new.model()), list(seen)
    finally:
        sync.OverlappedReduction.finish = finish


def _guards(out, tensors):
    info = dist_info()
    local = shard_batch(global_batch())

    def nan_on_rank_1(state, mb, **d):
        loss, m = make_loss("token_mean")(state, mb, **d)
        return loss * (float("nan") if info.rank == 1 else 1.0), m

    state = model_state()
    before = flat(state.model())
    new, metrics = update(state, local, nan_on_rank_1, mask_key=K.RESPONSE_MASK)
    out["nan"] = {"skipped": new.skipped_steps, "unchanged": bool(torch.equal(before, flat(new.model())))}

    def stop_on_rank_0(state, mb, **d):
        loss, m = make_loss("token_mean")(state, mb, **d)
        return loss, {**m, "early_stop": torch.tensor(info.rank == 0)}

    new, metrics = update(model_state(), local, stop_on_rank_0, minibatch_size=2, epochs=3, mask_key=K.RESPONSE_MASK,
                          transform=chain(skip_nonfinite(), stop_on("early_stop"), clip_by_global_norm(1.0)))
    out["stop"] = {"steps": new.optimizer_steps, "early_stop": float(metrics["early_stop"])}

    six = global_batch(6)  # rank 0 rows 0:2 (one minibatch of 2), rank 1 rows 2:6 (two): the ranks take 2 steps
    new, metrics = update(model_state(), six[:2] if info.rank == 0 else six[2:], make_loss("token_mean"),
                          minibatch_size=2, shuffle=False, mask_key=K.RESPONSE_MASK)
    tensors["steps_uneven"], out["steps_uneven"] = flat(new.model()), floats(metrics)
    try:
        agree([info.rank], what="ranks")
        out["agree"] = "no error"
    except ValueError as e:
        out["agree"] = str(e)


def _fold(out, tensors):
    info = dist_info()
    items = [{"x": [1.0, 2.0, 3.0, 4.0]}] * 2
    source = shard_source(items)

    def step(state, item):
        return state, {"rank": torch.tensor(float(info.rank)), "rows": float(len(item["x"]))}

    _, history = fold(step, init_state({}, seed=0), source)
    out["fold"] = history


PPO_STATS = dict(normalize=True, kl_controller="adaptive", kl_coef=0.2, target=0.05, horizon=40, kl="abs")


def ppo_statistics(rollouts):
    """``ppo.rewards_and_advantages`` on each rollout in turn: the KL coefficient, score moments and processed scores."""
    config = ppo.Config(**PPO_STATS)
    state = init_state({}, transforms={"kl": ppo.kl_controller("adaptive", coef=0.2).init(),
                                       "score_moments": running_moments_init()})
    seen = {}
    for i, rollout in enumerate(rollouts):
        state, prepared, _ = ppo.rewards_and_advantages(state, rollout, config)
        moments = state.transforms["score_moments"]
        seen[f"ppo/{i}/coef"] = torch.as_tensor(state.transforms["kl"].coef, dtype=DT).reshape(1)
        seen[f"ppo/{i}/moments"] = torch.stack([moments.count.to(DT), moments.mean, moments.m2])
        seen[f"ppo/{i}/score"] = prepared[K.SCORE].to(DT)
    return seen


def ppo_rollouts():
    return [make_rollout(B, 6, 4, dtype=DT, empty_rows=1, generator=torch.Generator().manual_seed(s)) for s in (7, 8)]


def _ppo_statistics(out, tensors):
    tensors.update(ppo_statistics([shard_batch(r) for r in ppo_rollouts()]))


def _checkpoint(out, tensors, run_dir):
    local = shard_batch(global_batch())
    for strategy in ("ddp", "fsdp2"):
        state = model_state(strategy, adam=True)
        state, _ = update(state, local, make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
        path = save_checkpoint(Path(run_dir) / strategy, state)
        tensors[f"ckpt/{strategy}/saved"] = flat(state.model())
        out[f"ckpt/{strategy}"] = str(path)
        state, _ = update(state, shard_batch(global_batch(seed=2)), make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
        tensors[f"ckpt/{strategy}/next"] = flat(state.model())
        # every rank can load it back into its wrapped model (and keeps training identically)
        fresh = load_checkpoint(path, model_state(strategy, adam=True))
        fresh, _ = update(fresh, shard_batch(global_batch(seed=2)), make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
        tensors[f"ckpt/{strategy}/reloaded_next"] = flat(fresh.model())


def _prefetch(out, tensors):
    """FSDP2's backward with and without gathering the next block ahead: per block, how many blocks were
    gathered past the one its backward reached (all-gathers counted as FSDP2 issues them), and the gradients."""
    events: list = []
    gather = torch.distributed.all_gather_single

    def recorded(*args, **kwargs):
        events.append("gather")
        return gather(*args, **kwargs)

    def mark(i):
        def hook(module, args, output):
            (output[0] if isinstance(output, tuple) else output).register_hook(lambda g: events.append(i))
        return hook

    from rlcore.loops.dist import FreedAfterReduce

    reduce, reduced = FreedAfterReduce.__call__, []

    def freed(self, output_tensor, input_tensor, *args, **kwargs):
        reduce(self, output_tensor, input_tensor, *args, **kwargs)
        reduced.append([input_tensor.numel(), input_tensor.untyped_storage().nbytes()])

    ids = torch.randint(0, 103, (2, 5), generator=torch.Generator().manual_seed(dist_info().rank))
    FreedAfterReduce.__call__ = freed
    try:
        _prefetch_runs(out, tensors, events, gather, recorded, mark, ids)
    finally:
        FreedAfterReduce.__call__ = reduce
    out["reduced"] = reduced


def _prefetch_runs(out, tensors, events, gather, recorded, mark, ids):
    for prefetch in (True, False):
        model = wrap_model(build_model("llama", vocab_size=103, hidden_size=16, num_layers=3, num_heads=2, dtype=DT),
                           strategy="fsdp2", backward_prefetch=prefetch)
        for i, block in enumerate(model.model.layers):
            block.register_forward_hook(mark(i))
        loss = model(ids).logits.log_softmax(-1).mean()
        events.clear()
        torch.distributed.all_gather_single = recorded
        try:
            loss.backward()
        finally:
            torch.distributed.all_gather_single = gather
        reached = [(events[:at].count("gather"), e) for at, e in enumerate(events) if e != "gather"]
        out[f"prefetch/{prefetch}/ahead"] = [gathered - (3 - i) for gathered, i in reached]
        grads = [p.grad.full_tensor() for p in model.parameters()]
        tensors[f"prefetch/{prefetch}"] = torch.cat([g.reshape(-1) for g in grads])


def _release(out, tensors):
    """After a no-grad scoring pass an FSDP2 model holds nothing gathered: its root's parameters are
    shards again (a forward alone leaves them whole), and the scores equal those of a held root."""
    from torch.distributed.tensor import DTensor

    from rlcore.loops.score import full_kl_from_models, score_rollout, score_sequences

    def sharded(model):
        return isinstance(model.model.embed_tokens.weight, DTensor)

    model = wrap_model(build_model("llama", vocab_size=103, hidden_size=16, num_layers=2, num_heads=2, dtype=DT),
                       strategy="fsdp2")
    rollout = recipe_batch()
    side = TensorDict({K.INPUT_IDS: rollout[K.PROMPT_IDS], K.ATTENTION_MASK: rollout[K.PROMPT_MASK],
                       K.LOSS_MASK: rollout[K.PROMPT_MASK]}, [B])
    seen = {"start": sharded(model)}
    with torch.no_grad():
        model(rollout[K.PROMPT_IDS])
    seen["forward"] = sharded(model)
    tensors["release/ref"] = score_sequences(model, side, reference=True)[K.REF_LOGPS]
    seen["score_sequences"] = sharded(model)
    with torch.no_grad():
        model(rollout[K.PROMPT_IDS])
    tensors["release/rollout"] = score_rollout(rollout, policy=model, ref=model)[K.REF_LOGPROBS]
    seen["score_rollout"] = sharded(model)
    tensors["release/again"] = score_sequences(model, side, reference=True)[K.REF_LOGPS]  # gathered anew
    with torch.no_grad():
        model(rollout[K.PROMPT_IDS])
    tensors["release/full_kl"] = full_kl_from_models(model, model, rollout)  # PPO's kl: full
    seen["full_kl"] = sharded(model)
    out["release"] = seen


def _worker(out_dir):
    info = dist_info()
    out, tensors = {"info": [info.rank, info.world_size, info.backend, is_main()]}, {}
    from rlcore.loops.dist import sync

    sync._OVERLAP_BUCKET_BYTES = 256  # many buckets, so the overlap and their order are exercised
    _equivalence(out, tensors)
    _overlap(out, tensors)
    _guards(out, tensors)
    _fold(out, tensors)
    _ppo_statistics(out, tensors)
    _checkpoint(out, tensors, Path(out_dir) / "runs")
    _prefetch(out, tensors)
    _release(out, tensors)
    write_rank(out_dir, info.rank, out, tensors)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    return run_ranks(_worker, out), out


# --- single-process references -------------------------------------------------------------------------
def one_process(mode):
    new, metrics = update(model_state(), global_batch(), make_loss(mode), mask_key=K.RESPONSE_MASK,
                          transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    return flat(new.model()), floats(metrics)


# --- the tests -------------------------------------------------------------------------------------------
def test_ranks_joined_one_group(ranks):
    (r0, _), (r1, _) = ranks[0]
    assert r0["info"] == [0, 2, "gloo", True] and r1["info"] == [1, 2, "gloo", False]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", WRAPS)
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, mode, strategy):
    (r0, t0), (r1, t1) = ranks[0]
    assert r0["local_tokens"] != r1["local_tokens"]  # unequal token counts per rank
    expected, metrics = one_process(mode)
    for t, r in ((t0, r0), (t1, r1)):
        torch.testing.assert_close(t[f"{mode}/{strategy}"], expected, **TOL)
        for name in ("loss", "loss_nll", "mean_lp", "grad_norm"):  # metrics of the global batch
            assert r[f"{mode}/{strategy}"][name] == pytest.approx(metrics[name], rel=1e-10, abs=1e-12), name
    assert (flat(model_state().model()) - expected).abs().max() > 1e-3  # the step moved the weights


@pytest.mark.parametrize("strategy", WRAPS)
def test_a_token_budget_on_two_ranks_equals_one_process(ranks, strategy):
    (_, t0), (_, t1) = ranks[0]
    expected, _ = one_process("token_mean")
    for t in (t0, t1):
        torch.testing.assert_close(t[f"budget/{strategy}"], expected, **TOL)


def test_fsdp2_without_backward_prefetch_gathers_each_block_only_when_its_backward_starts(ranks):
    for r, t in ranks[0]:
        assert r["prefetch/True/ahead"] == [1, 1, 0]  # blocks 2, 1 hold the next one gathered; block 0 has none
        assert r["prefetch/False/ahead"] == [0, 0, 0]
        torch.testing.assert_close(t["prefetch/False"], t["prefetch/True"], **TOL)


def test_under_gloo_each_reduce_scatter_frees_its_input_and_the_gradients_are_the_ranks_mean(ranks):
    for r, t in ranks[0]:
        assert len(r["reduced"]) == 2 * 4  # 3 blocks and the root, in each of the two backwards
        assert all(numel > 0 and nbytes == 0 for numel, nbytes in r["reduced"])
    model = build_model("llama", vocab_size=103, hidden_size=16, num_layers=3, num_heads=2, dtype=DT)
    for rank in (0, 1):  # each rank's loss on its own rows; FSDP2 averages the gradients over the ranks
        ids = torch.randint(0, 103, (2, 5), generator=torch.Generator().manual_seed(rank))
        (model(ids).logits.log_softmax(-1).mean() / 2).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for _, t in ranks[0]:
        torch.testing.assert_close(t["prefetch/False"], expected, **TOL)


def test_a_scoring_pass_leaves_nothing_of_an_fsdp2_model_gathered(ranks):
    for r, t in ranks[0]:
        assert r["release"] == {"start": True, "forward": False, "score_sequences": True, "score_rollout": True,
                                "full_kl": True}
        torch.testing.assert_close(t["release/again"], t["release/ref"], **TOL)
        torch.testing.assert_close(t["release/full_kl"], torch.zeros_like(t["release/full_kl"]), **TOL)  # π = π_ref
        assert torch.isfinite(t["release/rollout"]).all()


def test_recipe_loss_through_an_unwrapped_hf_policy(ranks):
    """GRPO's loss closure of loops.online (chunked trunk -> head path) runs unchanged on 2 ranks."""
    (r0, t0), (r1, t1) = ranks[0]
    new, metrics = update(recipe_state(), recipe_batch(), RECIPE_LOSS, mask_key=K.RESPONSE_MASK)
    for t, r in ((t0, r0), (t1, r1)):
        torch.testing.assert_close(t["recipe"], flat(new.model()), **TOL)
        assert r["recipe"]["loss"] == pytest.approx(float(metrics["loss"]), rel=1e-10, abs=1e-12)


def test_local_denominators_would_not_match(ranks):
    """The check above can fail: rank 0 alone (its own counts) gives other parameters."""
    (r0, t0), _ = ranks[0]
    expected, _ = one_process("token_mean")
    assert r0["denominators"]["num_tokens"] == int(global_batch()[K.RESPONSE_MASK].sum())
    alone, _ = update(model_state(), global_batch()[:4], make_loss("token_mean"), mask_key=K.RESPONSE_MASK,
                      transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    assert (flat(alone.model()) - expected).abs().max() > 1e-6


def test_row_mean_losses_weight_unequal_shards_by_global_rows(ranks):
    (r0, t0), (r1, t1) = ranks[0]
    new, metrics = update(model_state(), global_batch(7), row_mean_loss, transform=chain(skip_nonfinite()))
    torch.testing.assert_close(t0["rows"], flat(new.model()), **TOL)
    torch.testing.assert_close(t1["rows"], flat(new.model()), **TOL)
    assert r0["rows"]["loss_rows"] == pytest.approx(float(metrics["loss_rows"]), rel=1e-10)


@pytest.mark.parametrize("strategy", WRAPS)
def test_ranks_with_unequal_micro_batch_counts_equal_one_process(ranks, strategy):
    """FSDP2 needs as many forwards on each rank: the rank with one row runs it again at weight zero."""
    expected, _ = update(model_state(), global_batch(7), row_mean_loss, transform=chain(skip_nonfinite()))
    for _, t in ranks[0]:
        torch.testing.assert_close(t[f"uneven/{strategy}"], flat(expected.model()), **TOL)


@pytest.mark.parametrize("strategy", WRAPS)
def test_rows_not_counted_weigh_nothing(ranks, strategy):
    expected, metrics = update(model_state(), global_batch(7)[:4], make_loss("token_mean"), mask_key=K.RESPONSE_MASK,
                               transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    for r, t in ranks[0]:
        torch.testing.assert_close(t[f"uncounted/{strategy}"], flat(expected.model()), **TOL)
        for name in ("loss", "loss_nll", "mean_lp"):
            assert r[f"uncounted/{strategy}"][name] == pytest.approx(float(metrics[name]), rel=1e-10), name


def test_bucketed_sends_gradients_during_the_backward(ranks):
    for r, _ in ranks[0]:
        assert r["overlap/sent/None"] == []  # none: after the backward, no bucket
        (sent, buckets, late), = r["overlap/sent/bucketed"]  # one optimiser step
        assert buckets > 2 and 0 < sent <= buckets and not late


def test_a_bucket_of_frozen_parameters_does_not_hold_the_others_back(ranks):
    for r, t in ranks[0]:
        (sent, buckets, _), = r["frozen/sent/bucketed"]
        assert sent == buckets  # bucket 0 (frozen) went out before the backward, the rest during it
        torch.testing.assert_close(t["frozen/bucketed"], t["frozen/None"], **TOL)


def test_a_gradient_made_again_after_its_bucket_was_sent_is_reduced_again(ranks):
    for r, t in ranks[0]:
        (_, _, late), = r["late/seen/bucketed"]
        assert late
        torch.testing.assert_close(t["late/bucketed"], t["late/None"], **TOL)
    (_, t0), (_, t1) = ranks[0]
    assert torch.equal(t0["late/bucketed"], t1["late/bucketed"])


def test_nonfinite_guard_and_early_stop_are_agreed(ranks):
    (r0, _), (r1, _) = ranks[0]
    assert r0["nan"] == r1["nan"] == {"skipped": 1, "unchanged": True}  # NaN on rank 1 only: both skip
    assert r0["stop"] == r1["stop"] == {"steps": 0, "early_stop": 1.0}  # stop on rank 0 only: both stop


def test_a_rank_out_of_minibatches_steps_along_at_weight_zero(ranks):
    """Rank 0 has one minibatch, rank 1 two: step 1 is both ranks' first minibatches, step 2 rank 1's
    second alone (rank 0 runs its last row again, counted for nothing), as one process stepping twice."""
    six = global_batch(6)
    state, _ = update(model_state(), torch.cat([six[0:2], six[2:4]]), make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
    expected, _ = update(state, six[4:6], make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
    for r, t in ranks[0]:
        assert r["steps_uneven"]["optimizer_steps"] == 2
        torch.testing.assert_close(t["steps_uneven"], flat(expected.model()), **TOL)
        assert "ranks: the ranks disagree" in r["agree"]


def test_fold_logs_the_mean_over_ranks(ranks):
    (r0, _), (r1, _) = ranks[0]
    assert r0["fold"] == r1["fold"] == [{"rank": 0.5, "rows": 2.0}] * 2  # 4 rows split 2 + 2


def test_ppo_kl_controller_and_score_moments_see_every_rank(ranks):
    """Adaptive KL and score normalisation on 2 ranks equal 1 process on the global batch (TRL gathers them)."""
    (_, t0), (_, t1) = ranks[0]
    single = ppo_statistics(ppo_rollouts())
    for i in range(2):
        for t in (t0, t1):  # both ranks hold the global β and moments
            torch.testing.assert_close(t[f"ppo/{i}/coef"], single[f"ppo/{i}/coef"], **TOL)
            torch.testing.assert_close(t[f"ppo/{i}/moments"], single[f"ppo/{i}/moments"], **TOL)
        # each rank's scores are normalised with the global moments: its rows of the global result
        torch.testing.assert_close(torch.cat([t0[f"ppo/{i}/score"], t1[f"ppo/{i}/score"]]), single[f"ppo/{i}/score"], **TOL)
    # each rollout has one empty row, which counts as unscored (filters.exclude_unscored): 2·(B − 1) scores
    assert single["ppo/1/moments"][0] == 2 * (B - 1) and single["ppo/1/coef"] != single["ppo/0/coef"]
    # a rank on its own would see other statistics
    alone = ppo_statistics([shard_batch(r, rank=0, world_size=2) for r in ppo_rollouts()])
    assert not torch.allclose(alone["ppo/1/coef"], single["ppo/1/coef"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_rank0_checkpoint_loads_in_one_process_and_resumes(ranks, strategy):
    (r0, t0), (r1, t1) = ranks[0]
    path = Path(r0[f"ckpt/{strategy}"])
    assert r1[f"ckpt/{strategy}"] == str(path) and latest_checkpoint(path.parent) == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # one writer, nothing left over
    weights = load_file(str(path / "models" / "policy" / "model.safetensors"))
    assert not any(k.startswith("module.") for k in weights)
    # one process, plain module: the weights rank 0 saved, then one step on the whole next batch
    state = load_checkpoint(path, model_state(adam=True))
    torch.testing.assert_close(flat(state.model()), t0[f"ckpt/{strategy}/saved"], rtol=0, atol=0)
    state, _ = update(state, global_batch(seed=2), make_loss("token_mean"), mask_key=K.RESPONSE_MASK)
    for t in (t0, t1):
        torch.testing.assert_close(flat(state.model()), t[f"ckpt/{strategy}/next"], **TOL)
        torch.testing.assert_close(t[f"ckpt/{strategy}/reloaded_next"], t[f"ckpt/{strategy}/next"], **TOL)


# --- in-process pieces ------------------------------------------------------------------------------
def test_single_process_is_the_identity():
    info = init_distributed()
    assert info == DistInfo() and dist_info().world_size == 1 and is_main() and not info.distributed
    model = MockLM()
    assert all(wrap_model(model, strategy=s) is model for s in ("ddp", "fsdp2", None))
    assert grad_sync([model], list(model.parameters())) is None
    m = {"a": torch.tensor(1.0)}
    assert reduce_metrics(m) is m
    items = [1, 2]
    assert shard_source(items) is items and shard_batch(items) is items


def test_sync_helpers_are_plain_in_one_process():
    model = MockLM().to(DT)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert torch.equal(total_grad_norm(grads), torch.nn.utils.get_total_norm(grads))
    assert total_grad_norm([]) == 0
    before = [g.clone() for g in grads]
    reduce_gradients(None)
    with accumulation_context(None, last=False):
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, grads))
    assert all_ranks_ok(True) and not all_ranks_ok(False)
    assert full_weights(model) is None
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    sd = full_optimizer_state(opt)
    assert shard_optimizer_state(sd, opt) is sd


def test_drop_tied_keeps_one_name_per_tensor():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    weights = {"0.weight": torch.zeros(4, 3), "1.weight": torch.zeros(4, 3)}
    assert list(drop_tied(model, weights)) == ["0.weight"]


def test_gathered_is_the_tensor_itself_unsharded_and_goes_through_the_device_under_nccl(monkeypatch):
    from rlcore.loops import dist as D

    t = torch.ones(3)
    assert D.gathered(t) is t
    calls = []

    class Shard:  # a CPU-offloaded DTensor's interface
        device = torch.device("cpu")

        def to(self, device):
            calls.append(("to", str(device)))
            return self

        def full_tensor(self):
            calls.append(("full_tensor",))
            return torch.zeros(2)

    monkeypatch.setattr(D.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(D, "dist_info", lambda: DistInfo(rank=0, world_size=2, device=torch.device("cuda", 1)))
    assert torch.equal(D.gathered(Shard()), torch.zeros(2)) and calls == [("to", "cuda:1"), ("full_tensor",)]
    monkeypatch.setattr(D.dist, "get_backend", lambda *a: "gloo")
    calls.clear()
    D.gathered(Shard())
    assert calls == [("full_tensor",)]


def test_wrap_model_rejects_unknown_strategies():
    with pytest.raises(ValueError, match=r"strategy: unknown 'zero3'; valid: \['bucketed', 'ddp', 'fsdp2', 'none'\]"):
        wrap_model(MockLM(), strategy="zero3")
    assert sorted(STRATEGIES) == ["bucketed", "ddp", "fsdp2", "none"]


def test_init_distributed_needs_the_torchrun_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 but \['RANK', 'MASTER_ADDR', 'MASTER_PORT'\] are not set"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE: expected an integer"):
        init_distributed()


def test_torchrun_restarts_on_one_node_key_each_attempts_rendezvous(monkeypatch):
    """Under torchrun's --max-restarts the process group is joined through a store prefixed by the
    attempt on one node (one agent counts the attempts); on several nodes torch's own keys are kept."""
    import torch.distributed as dist

    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(kw["store"]))
    monkeypatch.setattr(dist, "rendezvous", lambda url, **kw: iter([(dist.HashStore(), kw["rank"], kw["world_size"])]))
    monkeypatch.setattr("rlcore.loops.dist.dist_info", lambda: None)
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for local, attempt in ((2, "3"), (1, "3"), (2, None)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        if attempt is None:
            monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        init_distributed(backend="gloo")
    keyed, multi_node, plain = joined
    assert isinstance(keyed, dist.PrefixStore) and multi_node is None and plain is None
    keyed.set("x", "1")
    assert keyed.underlying_store.get("rlcore/attempt-3/x") == b"1"


def test_shard_batch_blocks_concatenate_to_the_batch():
    td = TensorDict({"x": torch.arange(7)}, [7])
    parts = [shard_batch(td, rank=r, world_size=3) for r in range(3)]
    assert [p.batch_size[0] for p in parts] == [3, 2, 2]  # tensor_split's rule
    assert torch.equal(torch.cat([p["x"] for p in parts]), td["x"])
    assert [list(t) for t in torch.arange(7).tensor_split(3)] == [p["x"].tolist() for p in parts]
    cols = {"prompt": ["a", "b", "c"], "answer": ("1", "2", "3")}
    assert shard_batch(cols, rank=1, world_size=2) == {"prompt": ["c"], "answer": ("3",)}
    assert shard_batch([1, 2, 3, 4], rank=1, world_size=2) == [3, 4]
    with pytest.raises(ValueError, match="2 rows cannot be split over 3 ranks"):
        shard_batch([1, 2], rank=0, world_size=3)
    with pytest.raises(ValueError, match="different lengths"):
        shard_batch({"a": [1, 2], "b": [1]}, rank=0, world_size=2)
    with pytest.raises(TypeError, match="shard_batch: expected a TensorDict"):
        shard_batch(3, rank=0, world_size=2)


def test_shard_source_keeps_resumability():
    calls = []

    def source(start):
        calls.append(start)
        return ([i, i + 100] for i in range(start, 10))

    sharded = shard_source(source, rank=1, world_size=2)
    assert callable(sharded) and list(sharded(3))[:2] == [[103], [104]] and calls == [3]
    it = shard_source([[1, 2], [3, 4]], rank=0, world_size=2)
    assert list(it) == [[1], [3]] and list(it) == [[1], [3]]  # re-iterable: fold can replay it
