"""loops/sd.py and DDPO on a Stable Diffusion pipeline: the tiny offline pipeline round-trips through
its folder, the scheduler converts (or is refused), guidance with a negative prompt is the pipeline's
own, the collected log-probs are recomputed exactly, LoRA trains the adapter alone and exports to
the diffusers format, resume is exact, and bad pipelines, prompts and rewards get clear errors."""

import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from diffusers import DDIMScheduler  # noqa: E402

from rlcore import keys as K  # noqa: E402
from rlcore.algorithms.ddpo import ddim_step  # noqa: E402
from rlcore.loops.diffusion import row_condition, sample_trajectories, step_logprobs, timestep_rows  # noqa: E402
from rlcore.loops.images import jpeg_compressibility, score_images  # noqa: E402
from rlcore.loops.lora import is_peft  # noqa: E402
from rlcore.loops.recipes.ddpo import Config, build_state, collect, score, train, train_epoch  # noqa: E402
from rlcore.loops.sd import (LatentDecoder, TextEncoder, apply_unet_lora, build_tiny_sd, export_lora,  # noqa: E402
                             load_pipeline, pipeline_class, pipeline_schedule)

PROMPTS = ("a photo of a cat", "a painting of a dog", "an apple on a table")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd")
    build_tiny_sd(path, seed=0, prediction_type="sample")
    return path


def tiny(sd_dir, tmp_path, **overrides) -> Config:
    """The tiny pipeline, 3 DDIM steps, 2 batches of 2 samples per epoch, LoRA on the UNet."""
    fields = dict(model=str(sd_dir), train_use_lora=True, run_dir=str(tmp_path / "run"), prompts=PROMPTS,
                  sample_num_steps=3, sample_guidance_scale=3.0, sample_batch_size=2, sample_num_batches_per_epoch=2,
                  train_batch_size=1, train_learning_rate=1e-2, num_epochs=2, num_eval_images=3, lora_r=2,
                  lora_alpha=2)
    return Config(**{**fields, **overrides})


def adapter(state):
    return torch.cat([p.detach().reshape(-1).clone() for p in state.model().parameters() if p.requires_grad])


# --- the pipeline folder ---------------------------------------------------------------------------
def test_tiny_sd_round_trips_through_its_folder(sd_dir):
    assert sorted(p.name for p in sd_dir.iterdir()) == ["model_index.json", "scheduler", "text_encoder", "tokenizer",
                                                        "unet", "vae"]
    assert pipeline_class(sd_dir) == "StableDiffusionPipeline"
    built, loaded = build_tiny_sd(seed=0, prediction_type="sample"), load_pipeline(sd_dir)
    for a, b in [(built.unet, loaded.unet), (built.vae, loaded.vae), (built.text_encoder, loaded.text_encoder)]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = loaded.tokenizer(["a photo of a cat"], padding="max_length", max_length=16).input_ids[0]
    assert ids[0] == loaded.tokenizer.bos_token_id and loaded.tokenizer.eos_token_id in ids and len(ids) == 16
    assert len(set(ids)) > 3  # words are tokens, not unknowns
    # the SD 1.5 layout at a small width: four UNet levels, an 8x downsampling VAE
    sd15 = build_tiny_sd(shape="sd15")
    assert len(sd15.unet.config.block_out_channels) == 4 and 2 ** (len(sd15.vae.config.block_out_channels) - 1) == 8


def test_unsupported_and_broken_pipeline_folders(tmp_path, sd_dir):
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        pipeline_class(tmp_path)
    xl = tmp_path / "xl"
    xl.mkdir()
    (xl / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match=r"StableDiffusionXLPipeline; DDPO runs \['StableDiffusionPipeline'\]"):
        load_pipeline(xl)
    broken = tmp_path / "broken"
    shutil.copytree(sd_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError, match=r"lacks the pipeline's \['vae'\] folder"):
        load_pipeline(broken)
    (xl / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a pipeline index"):
        pipeline_class(xl)
    with pytest.raises(ValueError, match="StableDiffusionXLPipeline"):  # the recipe refuses it before loading weights
        (xl / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
        build_state(Config(model=str(xl), run_dir=None))


# --- the schedule -----------------------------------------------------------------------------------
def test_the_schedule_is_the_pipelines_own_and_follows_the_folder(sd_dir, tmp_path):
    """An old configuration (steps_offset 0, clip_sample true) runs as the pipeline corrects it; a
    folder rewritten in the same process is read again."""
    from rlcore.loops.recipes.ddpo import _schedule

    folder = tmp_path / "old"
    shutil.copytree(sd_dir, folder)
    path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "steps_offset": 0, "clip_sample": True}))
    cfg = tiny(folder, tmp_path, sample_num_steps=4)
    assert _schedule(cfg).timesteps.tolist() == [751, 501, 251, 1] and _schedule(cfg).prediction_type == "sample"
    path.write_text(json.dumps({**config, "prediction_type": "v_prediction"}))
    assert _schedule(cfg).prediction_type == "v_prediction"


def test_pipeline_schedule_is_diffusers_ddim_of_the_scheduler_config(sd_dir):
    sd15 = {"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
            "clip_sample": False, "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True,
            "steps_offset": 1, "trained_betas": None}  # SD 1.5's scheduler/scheduler_config.json
    schedule = pipeline_schedule(sd15, 10)
    ddim = DDIMScheduler.from_config(sd15)
    ddim.set_timesteps(10)
    assert torch.equal(schedule.timesteps, ddim.timesteps) and torch.equal(schedule.alphas_cumprod, ddim.alphas_cumprod)
    assert schedule.timesteps.tolist() == [901, 801, 701, 601, 501, 401, 301, 201, 101, 1]
    assert pipeline_schedule(load_pipeline(sd_dir).scheduler, 4).prediction_type == "sample"


@pytest.mark.parametrize("change, message", [
    (dict(clip_sample=True), "clip_sample"),
    (dict(thresholding=True), "thresholding"),
    (dict(timestep_spacing="linspace"), "timestep_spacing='linspace'"),
])
def test_schedulers_ddim_step_cannot_follow_are_refused(change, message):
    scheduler = DDIMScheduler(**{"beta_schedule": "scaled_linear", "clip_sample": False, "steps_offset": 1, **change})
    with pytest.raises(ValueError, match=message):
        pipeline_schedule(scheduler, 7)


# --- guidance, log-probs ---------------------------------------------------------------------------
def test_guidance_with_a_negative_prompt_is_the_pipelines_own(sd_dir):
    """Deterministic DDIM (eta 0) from the same noise: rlcore's chain ends where the pipeline's does."""
    pipe = load_pipeline(sd_dir)
    pipe.set_progress_bar_config(disable=True)
    encode, schedule = TextEncoder(pipe.tokenizer, pipe.text_encoder), pipeline_schedule(pipe.scheduler, 6)
    prompts, negative = ["a photo of a cat", "an apple"], ["a dog", ""]
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = {K.PROMPT_EMBEDS: encode(prompts), K.NEGATIVE_PROMPT_EMBEDS: encode(negative)}
        x = x_T
        from rlcore.loops.diffusion import predict_noise
        for t in schedule.timesteps.tolist():
            eps = predict_noise(pipe.unet, x, t, cond, guidance_scale=4.0)
            x = ddim_step(eps, t, x, eta=0.0, generator=torch.Generator(), **schedule.step_kwargs())[0]
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        theirs = pipe(prompts, negative_prompt=negative, num_inference_steps=6, guidance_scale=4.0, eta=0.0,
                      latents=x_T.clone(), height=16, width=16, output_type="latent").images
        images = LatentDecoder(pipe.vae)(x)
        their_images = pipe.image_processor.postprocess(pipe.vae.decode(theirs / 0.18215).sample, output_type="pt")
    scale = theirs.abs().max()
    torch.testing.assert_close(x / scale, theirs / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(images, their_images, rtol=0, atol=1e-4)
    with pytest.raises(KeyError, match="negative_prompt_embeds"):
        predict_noise(pipe.unet, x_T, 1, {K.PROMPT_EMBEDS: cond[K.PROMPT_EMBEDS]}, guidance_scale=2.0)
    with torch.no_grad():  # guidance runs for w > 1 only, as in the pipeline
        plain = pipe.unet(x_T, 500, encoder_hidden_states=cond[K.PROMPT_EMBEDS]).sample
        assert torch.equal(predict_noise(pipe.unet, x_T, 500, cond, guidance_scale=0.5), plain)


def test_collected_logprobs_are_recomputed_from_the_rows(sd_dir):
    pipe = load_pipeline(sd_dir)
    encode, schedule = TextEncoder(pipe.tokenizer, pipe.text_encoder), pipeline_schedule(pipe.scheduler, 4)
    with torch.no_grad():
        cond = {K.PROMPT_EMBEDS: encode(list(PROMPTS)), K.NEGATIVE_PROMPT_EMBEDS: encode([""] * 3)}
    traj = sample_trajectories(pipe.unet, cond, schedule, eta=1.0, guidance_scale=3.0,
                               generator=torch.Generator().manual_seed(1))
    assert traj.get(K.LATENTS).shape == (3, 5, 4, 8, 8) and traj.get(K.PROMPT_EMBEDS).shape == (3, 16, 32)
    rows = timestep_rows(traj.update({K.ADVANTAGES: torch.zeros(3)}), generator=torch.Generator().manual_seed(2))
    assert K.PROMPT_EMBEDS not in rows.keys()  # the embeddings stay per trajectory: gathered per micro-batch
    rows = rows.reshape(-1)
    with torch.no_grad():
        logp = torch.cat([step_logprobs(pipe.unet, row_condition(rows[i:i + 5], traj), schedule, guidance_scale=3.0)
                          for i in range(0, 12, 5)])
    torch.testing.assert_close(logp, rows.get(K.OLD_LOGPROBS), rtol=0, atol=1e-4)


# --- the recipe on the pipeline ------------------------------------------------------------------------
def test_lora_trains_the_adapter_alone_and_the_first_ratio_is_one(sd_dir, tmp_path):
    cfg = tiny(sd_dir, tmp_path, train_learning_rate=0.0)
    state = build_state(cfg)
    policy = state.model()
    assert is_peft(policy) and sorted(state.models) == ["policy", "text_encoder", "vae"]
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(p.requires_grad for name in ("text_encoder", "vae") for p in state.model(name).parameters())
    assert {id(p) for g in state.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in policy.parameters() if p.requires_grad}
    state, rollout = collect(state, cfg, jpeg_compressibility)
    assert rollout.get(K.IMAGES).shape == (4, 3, 16, 16) and len(rollout.get(K.PROMPT)) == 4
    state, rollout = score(state, rollout, cfg)
    _, metrics = train_epoch(state, rollout, cfg)
    assert metrics["clipfrac"] == 0 and abs(float(metrics["approx_kl"])) < 1e-6  # ratio 1: same model, same guidance


def test_gradient_checkpointing_takes_the_same_step(sd_dir, tmp_path):
    steps = []
    for checkpointing in (False, True):
        cfg = tiny(sd_dir, tmp_path, gradient_checkpointing=checkpointing, num_epochs=1)
        state = build_state(cfg)
        assert state.model().base_model.model.is_gradient_checkpointing == checkpointing
        state, _ = train_epoch(*score(*collect(state, cfg, jpeg_compressibility), cfg), cfg)
        steps.append(adapter(state))
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=1e-6)


def test_train_cfg_false_scores_the_conditional_model(sd_dir, tmp_path):
    cfg = tiny(sd_dir, tmp_path, train_learning_rate=0.0, train_cfg=False)
    state = build_state(cfg)
    state, rollout = score(*collect(state, cfg, jpeg_compressibility), cfg)
    _, metrics = train_epoch(state, rollout, cfg)
    assert float(metrics["approx_kl"]) > 1e-4  # sampled with guidance 3, scored without


def test_pipeline_run_exports_lora_and_resumes_exactly(sd_dir, tmp_path):
    """α ≠ r: the exported adapter carries its scale α/r into diffusers' loader."""
    full_state, full = train(tiny(sd_dir, tmp_path / "a", num_epochs=3, resume=True, lora_alpha=8))
    cfg = tiny(sd_dir, tmp_path / "b", num_epochs=2, resume=True, lora_alpha=8)
    train(cfg)
    run = tmp_path / "b" / "run"
    saved = sorted(p.name for p in (run / "checkpoint-2" / "models" / "policy").iterdir())
    assert "adapter_model.safetensors" in saved and not any("diffusion_pytorch_model" in n for n in saved)
    assert sorted(p.name for p in (run / "checkpoint-2" / "models").iterdir()) == ["policy"]  # frozen parts rebuilt
    state, resumed = train(dataclasses.replace(cfg, num_epochs=3))
    assert torch.equal(adapter(state), adapter(full_state))
    assert resumed[0]["reward_mean"] == full[2]["reward_mean"]
    assert resumed[0]["eval/reward_mean"] == full[2]["eval/reward_mean"]
    # the adapter in the diffusers LoRA format, loaded by a fresh pipeline, computes what the trained UNet does
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    fresh = load_pipeline(sd_dir)
    fresh.load_lora_weights(str(run / "lora"))
    x, t, e = torch.randn(2, 4, 8, 8), torch.tensor([500, 20]), torch.randn(2, 16, 32)
    with torch.no_grad():
        ours, theirs = state.model()(x, t, encoder_hidden_states=e).sample, fresh.unet(x, t, encoder_hidden_states=e).sample
        base = load_pipeline(sd_dir).unet(x, t, encoder_hidden_states=e).sample
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - base).abs().max() > 1e-4  # the adapter trained
    with pytest.raises(ValueError, match="no LoRA adapter"):
        export_lora(fresh.unet, tmp_path / "x")


def test_bf16_mixed_precision_keeps_frozen_weights_in_bf16(sd_dir, tmp_path):
    cfg = tiny(sd_dir, tmp_path, mixed_precision="bf16", train_learning_rate=0.0, num_epochs=1)
    state = build_state(cfg)
    dtypes = {p.dtype for n, p in state.model().named_parameters() if "lora_" not in n}
    assert dtypes == {torch.bfloat16} and {p.dtype for p in state.model().parameters() if p.requires_grad} == {
        torch.float32}
    assert {p.dtype for p in state.model("vae").parameters()} == {torch.bfloat16}
    state, rollout = score(*collect(state, cfg, jpeg_compressibility), cfg)
    assert rollout.get(K.LATENTS).dtype == torch.float32
    _, metrics = train_epoch(state, rollout, cfg)
    assert metrics["clipfrac"] == 0  # sampling and training run the same bf16 forwards


# --- prompts, rewards, hooks ------------------------------------------------------------------------------
def test_prompt_fn_metadata_reaches_the_reward_and_the_hook(sd_dir, tmp_path):
    seen, hooked = [], []
    prompts = itertools_cycle([("a photo of a cat", {"id": 1}), ("a red apple", {"id": 2})])

    def reward(images, prompts, metadata):
        seen.append((list(prompts), [m["id"] for m in metadata]))
        return torch.arange(len(prompts), dtype=torch.float32)

    cfg = tiny(sd_dir, tmp_path, num_epochs=1, eval_every=1)
    train(cfg, reward_fn=reward, prompt_fn=lambda: next(prompts),
          image_samples_hook=lambda data, step, run_dir: hooked.append((data, step, run_dir)))
    # the 3 held-out prompts are drawn first, then the epoch's 2 batches of 2; the evaluation reads metadata too
    assert seen == [(["a red apple", "a photo of a cat"], [2, 1])] * 2 + [(["a photo of a cat", "a red apple",
                                                                           "a photo of a cat"], [1, 2, 1])]
    [(data, step, run_dir)] = hooked
    images, names, metadata, rewards = data[-1]
    assert images.shape == (2, 3, 16, 16) and names == ["a red apple", "a photo of a cat"]
    assert metadata == [{"id": 2}, {"id": 1}] and rewards.tolist() == [0.0, 1.0] and (step, run_dir) == (1, cfg.run_dir)
    with pytest.raises(ValueError, match=r"prompt_fn: expected \(prompt: str, metadata\) pairs"):
        train(cfg, prompt_fn=lambda: "just a prompt")


def test_held_out_prompts_of_a_prompt_fn_are_fixed_and_leave_the_rngs(sd_dir, tmp_path):
    import random

    from rlcore.loops.recipes.ddpo import eval_prompts

    def prompt_fn():
        return random.choice(["a cat", "a dog", "an apple"]), {"n": random.random()}

    cfg = tiny(sd_dir, tmp_path, num_eval_images=6)
    random.seed(5)
    state = random.getstate()
    first = eval_prompts(cfg, prompt_fn)
    assert random.getstate() == state and eval_prompts(cfg, prompt_fn) == first and len(first[0]) == 6
    assert eval_prompts(dataclasses.replace(cfg, eval_seed=7), prompt_fn) != first


def itertools_cycle(items):
    while True:
        yield from items


def test_prompt_file_lines_and_json_lines(sd_dir, tmp_path):
    plain, rich, bad = tmp_path / "p.txt", tmp_path / "p.jsonl", tmp_path / "bad.jsonl"
    plain.write_text("a photo of a cat\n\nan apple\n")
    rich.write_text('{"prompt": "a cat", "style": "photo"}\n{"prompt": "a dog", "style": "oil"}\n')
    bad.write_text('{"prompt": "a cat"}\n{"text": "no prompt"}\n')
    from rlcore.loops.recipes.ddpo import prompt_table
    assert prompt_table(tiny(sd_dir, tmp_path, prompt_file=str(plain))) == (("a photo of a cat", "an apple"), ({}, {}))
    assert prompt_table(tiny(sd_dir, tmp_path, prompt_file=str(rich))) == (
        ("a cat", "a dog"), ({"style": "photo"}, {"style": "oil"}))
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: expected a JSON object with a 'prompt' string"):
        prompt_table(tiny(sd_dir, tmp_path, prompt_file=str(bad)))
    state = build_state(tiny(sd_dir, tmp_path, prompt_file=str(rich)))
    _, rollout = collect(state, tiny(sd_dir, tmp_path, prompt_file=str(rich)), lambda im, p, m: [len(m[0])] * len(p))
    assert set(rollout.get(K.PROMPT).tolist()) <= {"a cat", "a dog"}
    assert all(m["style"] in ("photo", "oil") for m in rollout.get(K.PROMPT_METADATA).tolist())


def test_bad_rewards_and_settings_are_named():
    images = torch.rand(3, 3, 8, 8)
    with pytest.raises(ValueError, match=r"reward_fn: expected rewards of shape \[3\]"):
        score_images(lambda im, p: torch.zeros(2), images, ["a"] * 3)
    with pytest.raises(ValueError, match=r"reward_fn: returned nan \(not finite\) for images \[1\] of 3"):
        score_images(lambda im, p: torch.tensor([0.0, float("nan"), 1.0]), images, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"reward_fn: returned inf \(not finite\) for images \[2\] of 3"):
        score_images(lambda im, p: torch.tensor([0.0, 1.0, float("inf")]), images, ["a", "b", "c"])
    with pytest.raises(ValueError, match="negative_prompts: expected one string"):
        Config(negative_prompts=["blurry", "ugly"])
    rewards = score_images(lambda im, p, m: (torch.ones(3), {"extra": 1}), images, ["a"] * 3, [{}] * 3)
    assert rewards.tolist() == [1.0, 1.0, 1.0]  # DDPO's (rewards, reward_metadata) pair
    with pytest.raises(ValueError, match="train_use_lora: a pipeline's UNet only"):
        Config(train_use_lora=True)
    with pytest.raises(ValueError, match="gradient_checkpointing: a pipeline's UNet only"):
        Config(gradient_checkpointing=True)
    with pytest.raises(ValueError, match="mixed_precision: expected 'bf16' or None, got 'fp16'"):
        Config(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"the tiny denoiser's classes are \['stripes'"):
        cfg = Config(run_dir=None, sample_size=8, block_out_channels=(8,), sample_batch_size=2)
        collect(build_state(cfg), cfg, jpeg_compressibility, prompt_fn=lambda: ("a photo of a cat", {}))


def test_unet_lora_targets_are_checked(sd_dir):
    unet = load_pipeline(sd_dir).unet
    with pytest.raises(ValueError, match=r"lora_target_modules: \['to_vv'\] match no module of the UNet"):
        apply_unet_lora(unet, target_modules=["to_q", "to_vv"])  # one typo among good names


def test_cli_trains_a_pipeline_folder_with_lora(sd_dir, tmp_path):
    from rlcore.loops.cli import main

    run = tmp_path / "cli"
    main(["train", "ddpo", "--model", str(sd_dir), "--train_use_lora", "true", "--run_dir", str(run),
          "--num_epochs", "1", "--sample_num_steps", "2", "--sample_batch_size", "2", "--train_batch_size", "2",
          "--sample_num_batches_per_epoch", "1", "--num_eval_images", "2", "--prompts", "a cat,a dog"])
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (run / "images" / "samples-00001.png").is_file() and (run / "checkpoint-1").is_dir()
    shutil.rmtree(run)


def test_aesthetic_scorer_round_trips_and_serves_as_the_reward(sd_dir, tmp_path):
    from safetensors.torch import save_file

    from rlcore.loops.aesthetic import HEAD_FILE, build_aesthetic_scorer, load_aesthetic_scorer, save_aesthetic_scorer

    scorer, images = build_aesthetic_scorer(seed=3), torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    scores = scorer(images, ["a"] * 4)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.unique().numel() == 4
    assert list(scorer.head.state_dict())[:2] == ["layers.0.weight", "layers.0.bias"]  # the LAION predictor's keys
    save_aesthetic_scorer(scorer, tmp_path / "scorer")
    torch.testing.assert_close(load_aesthetic_scorer(tmp_path / "scorer")(images), scores, rtol=0, atol=1e-6)
    cfg = tiny(sd_dir, tmp_path, reward_fn="aesthetic", reward_model=str(tmp_path / "scorer"))
    from rlcore.loops.recipes.ddpo import reward_function
    torch.testing.assert_close(score_images(reward_function(cfg), images, ["a"] * 4), scores, rtol=0, atol=1e-6)
    _, rollout = collect(build_state(cfg), cfg, reward_function(cfg))
    assert rollout.get(K.SCORE).shape == (4,)
    with pytest.raises(ValueError, match=r"images: expected float \[B, 3, H, W\]"):
        scorer(torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"expected values in \[0, 1\], got \[-1"):
        scorer(images * 2 - 1)
    wide = torch.cat([torch.zeros(4, 3, 16, 4), images, torch.ones(4, 3, 16, 4)], dim=-1)
    torch.testing.assert_close(scorer(wide), scores, rtol=0, atol=1e-6)  # the centre square is scored
    save_file({"layers.0.weight": torch.zeros(1024, 7)}, str(tmp_path / "scorer" / HEAD_FILE))
    with pytest.raises(ValueError, match="does not fit a head over 32-wide embeddings"):
        load_aesthetic_scorer(tmp_path / "scorer")
    (tmp_path / "scorer" / HEAD_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no aesthetic_head.safetensors"):
        load_aesthetic_scorer(tmp_path / "scorer")
