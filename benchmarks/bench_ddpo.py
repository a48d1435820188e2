"""DDPO on the tiny offline Stable Diffusion pipeline (``rlcore.loops.sd.build_tiny_sd``).

Case (``run.py``): one DDPO epoch with LoRA on the UNet (sampling with guidance and per-step
log-probs, VAE decode, JPEG reward, advantages, the clipped update over the kept steps), rlcore's
recipe against a plain diffusers loop written here that does the same work: the same pipeline,
adapter, samples, steps, micro-batches and optimiser steps. Project goals (aimed at, not
asserted): ≥ 1.3× faster, ≤ 0.7× peak memory.

Learning (``python benchmarks/bench_ddpo.py [--tiny]``): ``configs/ddpo_sd.yaml`` on three seeds
(the pipeline built and its VAE fitted with each seed); the held-out reward (fixed noise) before
and after, and the wall-clock time. Goal: higher in every seed, each run under 10 minutes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _config(folder: str, tiny: bool, **overrides):
    """``configs/ddpo_sd.yaml`` on ``folder``; ``tiny``: 2 steps, one batch of 2, 2 epochs."""
    from rlcore.loops.config import load_config
    from rlcore.loops.recipes.ddpo import Config

    cfg = load_config(Config, ROOT / "configs" / "ddpo_sd.yaml")
    small = dict(sample_num_steps=2, sample_batch_size=2, train_batch_size=2, sample_num_batches_per_epoch=1,
                 num_epochs=2, eval_every=1, num_eval_images=2) if tiny else {}
    return dataclasses.replace(cfg, **{"model": folder, "run_dir": None, **small, **overrides})


def _pipeline(tiny: bool, seed: int = 0) -> str:
    from rlcore.loops.sd import build_tiny_sd

    folder = tempfile.mkdtemp(prefix="rlcore-bench-sd-")
    build_tiny_sd(folder, seed=seed, prediction_type="sample", vae_steps=5 if tiny else 300)
    return folder


# --- one epoch: rlcore's recipe ------------------------------------------------------------------------
def _rlcore_epoch(tiny: bool):
    def builder():
        from rlcore.loops.images import jpeg_compressibility
        from rlcore.loops.recipes import ddpo

        cfg = _config(_pipeline(tiny), tiny)
        state = ddpo.build_state(cfg)
        box = [state]

        def epoch():
            box[0], _ = ddpo.step(box[0], None, config=cfg, reward_fn=jpeg_compressibility)
        return epoch
    return builder


# --- one epoch: a plain diffusers loop --------------------------------------------------------------------
def _ddim_logprob(scheduler, eps, t: torch.Tensor, x, eta: float, generator=None, prev=None):
    """DDIM steps ``x_t → x_{t'}`` (``t [n]``) with their Gaussian log-densities averaged over the latent
    dims, as DDPO writes them."""
    step = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    a_t = scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    a_prev = torch.where(t - step >= 0, scheduler.alphas_cumprod[(t - step).clamp(min=0)],
                         scheduler.final_alpha_cumprod).view(-1, 1, 1, 1)
    if scheduler.config.prediction_type == "sample":
        x0, eps_hat = eps, (x - a_t ** 0.5 * eps) / (1 - a_t) ** 0.5
    else:
        x0, eps_hat = (x - (1 - a_t) ** 0.5 * eps) / a_t ** 0.5, eps
    std = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) ** 0.5
    mean = a_prev ** 0.5 * x0 + (1 - a_prev - std ** 2) ** 0.5 * eps_hat
    if prev is None:
        prev = mean + std * torch.randn(x.shape, generator=generator, dtype=x.dtype)
    logp = -((prev.detach() - mean) ** 2) / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return prev, logp.mean(dim=(1, 2, 3))


def _diffusers_epoch(tiny: bool):
    def builder():
        import io

        import peft
        from diffusers import DDIMScheduler, StableDiffusionPipeline
        from PIL import Image

        cfg = _config(_pipeline(tiny), tiny)
        pipe = StableDiffusionPipeline.from_pretrained(cfg.model, local_files_only=True, safety_checker=None,
                                                       requires_safety_checker=False)
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        pipe.scheduler.set_timesteps(cfg.sample_num_steps)
        unet = peft.get_peft_model(pipe.unet.requires_grad_(False), peft.LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_target_modules)))
        pipe.text_encoder.requires_grad_(False)
        pipe.vae.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=cfg.train_learning_rate,
                                betas=(cfg.train_adam_beta1, cfg.train_adam_beta2),
                                weight_decay=cfg.train_adam_weight_decay, eps=cfg.train_adam_epsilon)
        g, w = torch.Generator().manual_seed(0), cfg.sample_guidance_scale
        timesteps, all_t = pipe.scheduler.timesteps.tolist(), pipe.scheduler.timesteps.long()

        def embed(texts):
            ids = pipe.tokenizer(texts, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                                 truncation=True, return_tensors="pt").input_ids
            return pipe.text_encoder(ids)[0]

        def guided(x, t, pos, neg):
            out = unet(torch.cat([x, x]), torch.cat([t, t]), encoder_hidden_states=torch.cat([neg, pos])).sample
            u, c = out.chunk(2)
            return u + w * (c - u)

        def epoch():
            samples = []
            with torch.no_grad():
                for _ in range(cfg.sample_num_batches_per_epoch):
                    prompts = [cfg.prompts[i] for i in torch.randint(len(cfg.prompts), (cfg.sample_batch_size,),
                                                                      generator=g).tolist()]
                    pos, neg = embed(prompts), embed([cfg.negative_prompts] * len(prompts))
                    x = torch.randn(len(prompts), 4, unet.config.sample_size, unet.config.sample_size, generator=g)
                    chain, logps = [x], []
                    for step in timesteps:
                        t = torch.full((len(x),), step)
                        x, logp = _ddim_logprob(pipe.scheduler, guided(x, t, pos, neg), t, x, cfg.sample_eta, g)
                        chain.append(x)
                        logps.append(logp)
                    images = (pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
                    rewards = []
                    for im in (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
                        buffer = io.BytesIO()
                        Image.fromarray(im).save(buffer, format="JPEG", quality=95)
                        rewards.append(-buffer.tell() / 1000)
                    samples.append((torch.stack(chain, 1), torch.stack(logps, 1), pos, neg, torch.tensor(rewards)))
            rewards = torch.cat([s[4] for s in samples])
            adv = ((rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-8)).clamp(-cfg.train_adv_clip_max,
                                                                                        cfg.train_adv_clip_max)
            kept = int(cfg.sample_num_steps * cfg.train_timestep_fraction)
            for i, (chain, old, pos, neg, _) in enumerate(samples):
                a = adv[i * cfg.sample_batch_size:(i + 1) * cfg.sample_batch_size]
                order = torch.rand(len(a), cfg.sample_num_steps, generator=g).argsort(dim=-1)[:, :kept]
                rows = torch.arange(len(a))
                for j in range(kept):
                    idx = order[:, j]
                    for s in range(0, len(a), cfg.train_batch_size):
                        r, k = rows[s:s + cfg.train_batch_size], idx[s:s + cfg.train_batch_size]
                        t = all_t[k]
                        _, logp = _ddim_logprob(pipe.scheduler, guided(chain[r, k], t, pos[r], neg[r]), t, chain[r, k],
                                                cfg.sample_eta, prev=chain[r, k + 1])
                        ratio = torch.exp(logp - old[r, k])
                        clipped = ratio.clamp(1 - cfg.train_clip_range, 1 + cfg.train_clip_range)
                        loss = torch.maximum(-a[r] * ratio, -a[r] * clipped).mean() / (kept * len(a) / len(r))
                        loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in unet.parameters() if p.requires_grad],
                                               cfg.train_max_grad_norm)
                opt.step()
                opt.zero_grad()
        return epoch
    return builder


def cases(tiny: bool) -> dict[str, dict]:
    c = _config("", tiny)
    name = (f"ddpo epoch tiny-sd LoRA S={c.sample_num_steps} B={c.sample_batch_size}x{c.sample_num_batches_per_epoch}"
            f" micro={c.train_batch_size}")
    return {name: {"rlcore": _rlcore_epoch(tiny), "diffusers_loop": _diffusers_epoch(tiny)}}


def goals(tiny: bool) -> dict[str, list[tuple[str, str, float]]]:
    return {name: [("speedup", "diffusers_loop", 1.3), ("memory", "diffusers_loop", 0.7)] for name in cases(tiny)}


# --- learning -----------------------------------------------------------------------------------------------
def learning(tiny: bool, seeds=(0, 1, 2)) -> list[dict]:
    """``configs/ddpo_sd.yaml`` on each seed: held-out reward before and after, seconds."""
    from rlcore.loops.recipes import ddpo

    rows = []
    for seed in seeds:
        start = time.perf_counter()
        folder = _pipeline(tiny, seed)
        cfg = _config(folder, tiny, seed=seed)
        before = ddpo.evaluate(ddpo.build_state(cfg), cfg)["reward_mean"]
        _, history = ddpo.train(cfg)
        after = [h["eval/reward_mean"] for h in history if "eval/reward_mean" in h][-1]
        rows.append(dict(seed=seed, before=before, after=after, seconds=time.perf_counter() - start))
    return rows


def main(tiny: bool, threads: int) -> None:
    torch.set_num_threads(threads)
    rows = learning(tiny)
    print(f"\nDDPO with LoRA on the tiny SD, configs/ddpo_sd.yaml, {threads} threads: held-out JPEG reward "
          "(−kB, 16 fixed-noise images)\n")
    print("| seed | before | after | gain | seconds (pipeline build, VAE fit and training) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['seed']} | {r['before']:.4f} | {r['after']:.4f} | {r['after'] - r['before']:+.4f} | "
              f"{r['seconds']:.0f} |")
    gains = [r["after"] - r["before"] for r in rows]
    print(f"\nmean gain {statistics.fmean(gains):+.4f}; higher in {sum(g > 0 for g in gains)} of {len(rows)} seeds; "
          f"longest run {max(r['seconds'] for r in rows):.0f} s")


if __name__ == "__main__":
    args = sys.argv[1:]
    main("--tiny" in args, int(args[args.index("--threads") + 1]) if "--threads" in args else 2)
