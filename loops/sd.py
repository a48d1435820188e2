"""Stable Diffusion pipelines in DDPO: a diffusers text-to-image pipeline folder as the models of
``loops.diffusion`` (text conditioning, latents, a VAE decode before the reward).

- :func:`load_pipeline`: a local pipeline folder (``save_pretrained`` layout), its type checked
  from ``model_index.json`` before any weight is read (``SUPPORTED_PIPELINES``);
- :func:`pipeline_schedule`: the pipeline's scheduler configuration as a DDIM schedule (what
  diffusers' ``DDIMScheduler.from_config`` makes of it), refused when ``ddim_step`` cannot follow it;
- :class:`TextEncoder` / :class:`LatentDecoder`: the frozen halves as modules: prompts to
  ``prompt_embeds [B, L, D]`` as the pipeline encodes them, latents to images in ``[0, 1]`` as the
  pipeline decodes them;
- :func:`apply_unet_lora` / :func:`export_lora`: peft LoRA on the UNet's attention projections,
  exported in the diffusers LoRA format (``pipeline.load_lora_weights(folder)`` reads it);
- :func:`build_tiny_sd`: a Stable Diffusion pipeline assembled from configs (UNet2DConditionModel,
  a CLIP text model with a BPE tokenizer trained offline, AutoencoderKL, DDIMScheduler), small
  enough for tests; ``shape="sd15"`` has Stable Diffusion 1.5's block layout at a small width.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.checks import lookup
from rlcore.loops.diffusion import DDIMSchedule, schedule_from_scheduler
from rlcore.loops.images import require_extra

try:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
except ImportError:  # optional extra
    AutoencoderKL = DDIMScheduler = StableDiffusionPipeline = UNet2DConditionModel = None

__all__ = ["SUPPORTED_PIPELINES", "LORA_TARGETS", "pipeline_class", "load_pipeline", "scheduler_config",
           "pipeline_schedule",
           "TextEncoder", "LatentDecoder", "apply_unet_lora", "export_lora", "build_clip_tokenizer", "TINY_SD_SHAPES",
           "fit_vae", "build_tiny_sd"]

# model_index.json ``_class_name`` -> what it covers. SDXL (two text encoders, added time ids), SD 3
# (a transformer, flow matching) and the others have other conditioning: not supported.
SUPPORTED_PIPELINES = {"StableDiffusionPipeline": "Stable Diffusion 1.x and 2.x: one CLIP text encoder, a "
                                                  "UNet2DConditionModel, an AutoencoderKL"}
# The UNet's attention projections, DDPO's LoRA targets.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def pipeline_class(path: str | Path) -> str:
    """The pipeline class a folder holds (``model_index.json``), checked against ``SUPPORTED_PIPELINES``.

    Raises:
        FileNotFoundError: not a pipeline folder.  ValueError: an unreadable index or another type.
    """
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"model: {path} is not a diffusers pipeline folder (no model_index.json)")
    try:
        name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: {index} is not a pipeline index (no readable _class_name): {e}") from None
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(f"model: {path} holds a {name}; DDPO runs {sorted(SUPPORTED_PIPELINES)} "
                         f"({'; '.join(SUPPORTED_PIPELINES.values())})")
    parts = ("text_encoder", "tokenizer", "unet", "vae", "scheduler")
    missing = [p for p in parts if not (Path(path) / p).is_dir()]
    if missing:
        raise FileNotFoundError(f"model: {path} lacks the pipeline's {missing} folder(s) (a {name} needs {list(parts)})")
    return name


def load_pipeline(path: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """The pipeline of a local folder, offline (no safety checker), after ``pipeline_class``."""
    require_extra(StableDiffusionPipeline, "load_pipeline", "diffusers")
    pipeline_class(path)
    return StableDiffusionPipeline.from_pretrained(str(path), local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False, torch_dtype=dtype)


def scheduler_config(path: str | Path) -> dict[str, Any]:
    """The scheduler configuration of a pipeline folder as the pipeline runs it: ``StableDiffusionPipeline``
    corrects two settings of old configurations when it loads them (``steps_offset`` to 1,
    ``clip_sample`` to False), and so does this."""
    require_extra(DDIMScheduler, "scheduler_config", "diffusers")
    config = dict(DDIMScheduler.load_config(str(path), subfolder="scheduler"))
    return {**config, "steps_offset": 1, "clip_sample": False}


def pipeline_schedule(scheduler: Any, num_inference_steps: int) -> DDIMSchedule:
    """The DDIM schedule of a pipeline's scheduler (or of its configuration, a mapping):
    ``DDIMScheduler.from_config(scheduler.config)`` as DDPO does; the noise schedule, prediction
    type and timestep spacing are the pipeline's.

    Raises:
        ValueError: a configuration ``ddim_step`` cannot follow: clipping or thresholding of
            ``x̂_0``, a prediction type it lacks, or timesteps not evenly spaced by
            ``num_train_timesteps // num_inference_steps`` (``timestep_spacing="linspace"``).
    """
    require_extra(DDIMScheduler, "pipeline_schedule", "diffusers")
    try:
        ddim = DDIMScheduler.from_config(getattr(scheduler, "config", scheduler))
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"scheduler: {type(scheduler).__name__} does not convert to DDIM: {e}") from None
    schedule = schedule_from_scheduler(ddim, num_inference_steps)
    stride = schedule.num_train_timesteps // num_inference_steps
    gaps = (schedule.timesteps[:-1] - schedule.timesteps[1:]).unique().tolist()
    if gaps and gaps != [stride]:
        raise ValueError(f"scheduler: timestep_spacing={ddim.config.timestep_spacing!r} gives steps {gaps} apart; "
                         f"ddim_step steps by num_train_timesteps // num_inference_steps = {stride} "
                         "(use 'leading' or 'trailing')")
    return schedule


class TextEncoder(nn.Module):
    """Prompts to ``prompt_embeds [B, L, D]`` as a Stable Diffusion pipeline encodes them: the
    tokenizer pads and truncates to its ``model_max_length``, the text model's last hidden state.
    Frozen (no parameter requires grad)."""

    def __init__(self, tokenizer: Any, text_model: nn.Module):
        super().__init__()
        self.tokenizer, self.text_model = tokenizer, text_model.requires_grad_(False).eval()

    def forward(self, prompts: Sequence[str]) -> torch.Tensor:
        ids = self.tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        return self.text_model(ids.to(next(self.text_model.parameters()).device))[0]


class LatentDecoder(nn.Module):
    """Latents ``[B, 4, h, w]`` to images ``[B, 3, H, W]`` in ``[0, 1]`` as the pipeline decodes
    them: ``vae.decode(z / scaling_factor)``, then ``clamp(x/2 + 1/2, 0, 1)``. Frozen."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae.requires_grad_(False).eval()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vae.parameters()).dtype
        images = self.vae.decode(latents.to(dtype) / self.vae.config.scaling_factor).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)


def apply_unet_lora(unet: nn.Module, *, r: int = 4, alpha: int = 4, target_modules: Sequence[str] = LORA_TARGETS,
                    seed: int = 0) -> nn.Module:
    """``unet`` as a peft model with a LoRA adapter on ``target_modules`` (``B = 0``: it computes
    what ``unet`` computes); only the adapter requires grad, the base weights are frozen."""
    from rlcore.loops.lora import _peft, _wrap

    names = [n for n, _ in unet.named_modules()]
    unmatched = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"lora_target_modules: {unmatched} match no module of the UNet; DDPO's are "
                         f"{list(LORA_TARGETS)}")
    lora = _peft().LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules))
    try:
        return _wrap(unet, lora, seed=seed)
    except ValueError as e:
        raise ValueError(f"lora_target_modules: {list(target_modules)} do not fit the UNet ({e}); DDPO's are "
                         f"{list(LORA_TARGETS)}") from None


def export_lora(policy: nn.Module, directory: str | Path) -> Path:
    """The LoRA adapter of a UNet trained by DDPO (``apply_unet_lora``), written in the diffusers
    LoRA format: ``directory/pytorch_lora_weights.safetensors``, loaded into any pipeline of the
    same base by ``pipeline.load_lora_weights(directory)``. On several ranks every rank calls it (an
    FSDP2 adapter's shards are gathered) and rank 0 writes."""
    from rlcore.loops.dist import gathered, is_main
    from rlcore.loops.lora import adapter_keys, is_peft

    require_extra(StableDiffusionPipeline, "export_lora", "diffusers")
    if not is_peft(policy):
        raise ValueError("policy: no LoRA adapter to export (the run did not set train_use_lora)")
    prefix = "base_model.model."
    layers = {k.removeprefix(prefix): gathered(v).detach().float().cpu()
              for k, v in adapter_keys(policy).items()}  # FSDP2 shards gathered: every rank calls this
    if not is_main():  # on several ranks, rank 0 writes
        return Path(directory)
    lora = policy.peft_config["default"]
    metadata = {"r": lora.r, "lora_alpha": lora.lora_alpha, "target_modules": sorted(lora.target_modules)}
    StableDiffusionPipeline.save_lora_weights(str(directory), unet_lora_layers=layers, safe_serialization=True,
                                              unet_lora_adapter_metadata=metadata)  # α ≠ r loads with its scale
    return Path(directory)


# --- a tiny Stable Diffusion, offline --------------------------------------------------------------
def build_clip_tokenizer(texts: Sequence[str], *, vocab_size: int = 512, max_length: int = 16) -> Any:
    """A CLIP tokenizer (``transformers.CLIPTokenizer``: byte-level BPE, ``</w>`` word ends, start
    and end tokens) whose merges are trained offline with ``tokenizers`` on ``texts``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE(unk_token=specials[1], end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    bpe = json.loads(tok.to_str())["model"]
    return CLIPTokenizer(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]], model_max_length=max_length)


# name -> (UNet blocks: (channels, cross-attention?) per level, layers per block, VAE channels per level,
#          text width and layers, latent size). "sd15": SD 1.5's layout (three cross-attention levels and a
#          plain one, two layers per block, a VAE of four levels: 8× downsampling) at a small width.
TINY_SD_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(unet=((32, True), (64, False)), layers=1, vae=(16, 32), text=(32, 2), latent=8),
    "sd15": dict(unet=((32, True), (64, True), (64, True), (64, False)), layers=2, vae=(16, 32, 32, 32),
                 text=(64, 4), latent=8),
}
DEFAULT_TEXTS = ("stripes", "checkers", "blob", "a photo of a cat", "a painting of a dog", "an apple on a table")


def fit_vae(vae: nn.Module, *, steps: int, seed: int = 0, batch_size: int = 16, lr: float = 2e-3) -> float:
    """Train ``vae`` as an autoencoder for ``steps`` Adam steps (in place) on random images, each a
    mix of a smooth field and pixel noise (reconstruction MSE plus a 1e-6 KL term), then set its
    ``scaling_factor`` to ``1 / std`` of the latents (how Stable Diffusion's 0.18215 was chosen).
    Returns the last reconstruction loss. A fitted decoder keeps smooth latents smooth and noisy
    ones noisy, as a real VAE does; a random one paints its own texture over both."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    size = vae.config.sample_size

    def images(n: int) -> torch.Tensor:
        smooth = F.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=size, mode="bilinear")
        w = torch.rand(n, 1, 1, 1, generator=g)
        return (w * smooth + (1 - w) * torch.rand(n, 3, size, size, generator=g)) * 2 - 1

    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = images(batch_size)
        posterior = vae.encode(x).latent_dist
        loss = F.mse_loss(vae.decode(posterior.sample(generator=g)).sample, x)
        optimizer.zero_grad()
        (loss + 1e-6 * posterior.kl().mean()).backward()
        optimizer.step()
    vae.eval()
    with torch.no_grad():
        std = vae.encode(images(64)).latent_dist.mean.std()
    vae.register_to_config(scaling_factor=float(1 / std))
    return loss.item()


def build_tiny_sd(directory: str | Path | None = None, *, shape: str = "tiny", seed: int = 0,
                  texts: Sequence[str] = DEFAULT_TEXTS, max_length: int = 16,
                  prediction_type: str = "epsilon", vae_steps: int = 0) -> Any:
    """A ``StableDiffusionPipeline`` assembled from configs, nothing downloaded, seeded; saved with
    ``save_pretrained`` to ``directory`` when given (``load_pipeline(directory)`` reads it back).

    The scheduler is Stable Diffusion's DDIM configuration (``scaled_linear`` β from 0.00085 to
    0.012, ``steps_offset=1``, ``set_alpha_to_one=False``, no clipping); the VAE's scaling factor
    is SD's 0.18215. ``shape``: a key of ``TINY_SD_SHAPES``. ``prediction_type``: the
    scheduler's (``"sample"`` gives a UNet of random weights direct control of the final latents:
    what the learning tests and notebooks use; ``"epsilon"`` is Stable Diffusion's).
    ``vae_steps``: ``fit_vae`` steps for the VAE (0: random weights, scaling factor 0.18215).
    """
    require_extra(StableDiffusionPipeline, "build_tiny_sd", "diffusers")
    from transformers import CLIPTextConfig, CLIPTextModel

    s = lookup(TINY_SD_SHAPES, shape, what="shape")
    tokenizer = build_clip_tokenizer(texts, max_length=max_length)
    width, layers = s["text"]
    unet_channels = tuple(c for c, _ in s["unet"])
    vae_levels = len(s["vae"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_model = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=max_length, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
        unet = UNet2DConditionModel(
            sample_size=s["latent"], in_channels=4, out_channels=4, block_out_channels=unet_channels,
            layers_per_block=s["layers"], cross_attention_dim=width, attention_head_dim=8, norm_num_groups=8,
            down_block_types=tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for _, a in s["unet"]),
            up_block_types=tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for _, a in reversed(s["unet"])))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=s["vae"],
                            down_block_types=("DownEncoderBlock2D",) * vae_levels,
                            up_block_types=("UpDecoderBlock2D",) * vae_levels, norm_num_groups=8,
                            sample_size=s["latent"] * 2 ** (vae_levels - 1), scaling_factor=0.18215)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, prediction_type=prediction_type)
    pipeline = StableDiffusionPipeline(vae=vae, text_encoder=text_model, tokenizer=tokenizer, unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipeline.set_progress_bar_config(disable=True)
    if vae_steps:
        fit_vae(vae, steps=vae_steps, seed=seed)
    if directory is not None:
        pipeline.save_pretrained(str(directory))
    return pipeline


if __name__ == "__main__":  # python -m rlcore.loops.sd FOLDER: the tiny pipeline of configs/ddpo_sd.yaml
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlcore.loops.sd FOLDER  (a tiny Stable Diffusion pipeline, built offline)")
    build_tiny_sd(sys.argv[1], prediction_type="sample", vae_steps=300)
    print(f"tiny Stable Diffusion pipeline (UNet predicting x_0, VAE fitted for 300 steps) in {sys.argv[1]}")
