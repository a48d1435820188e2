"""ReFT on any Hugging Face causal LM: interventions installed with forward hooks, saved as safetensors.

``reft_interventions(model, spec, interventions, locations)`` is a context manager: inside it,
every forward of ``model`` edits the hidden states of the blocks in ``spec.layers`` at the columns
``locations [B, n]`` (``rlcore.loops.reft_data``); on exit the hooks are removed and the model is
exactly the base model again (no weight is touched, ever). Outside the context the same model is
the frozen base policy, so ReFT DPO needs no second model for its reference.

The block list is found generically (``find_blocks``): the ``nn.ModuleList`` holding
``config.num_hidden_layers`` blocks (``model.layers`` for Llama-style models, ``transformer.h``
for GPT-2-style ones), or the dotted path ``spec.blocks``. A pre-hook on the module that owns
the list reads the KV cache's length (``forward_offset``; the cache is found by type, whatever
name the transformers version passes it under) so that the columns of the current forward are
known: the locations index the full sequence, and a forward that starts at column ``offset``
edits ``locations − offset`` where that falls inside it.

Generation with a KV cache: the prefill forward covers the prompt and is edited at the prompt
positions; every decoding step starts past the prompt, so nothing is edited there. Only prompt
positions are intervened, the keys and values cached for them carry the edit to every later
token, and a full forward over ``[prompt | response]`` inside the context reproduces the
generation's log-probs (the rollout can be re-scored with the same locations).

Recipes: ``intervened(state, batch)`` is that context for a loop state (a ``ReftModel`` policy, or
a plain policy with ``state.models["interventions"]``), and ``with_interventions(loss_fn)`` turns
any ``update`` loss closure into its ReFT version. ``save_interventions`` / ``load_interventions``
store a spec (JSON) and the weights (safetensors), no pickle.

**Impure by nature**: installing registers hooks on the model (removed on exit) and the hooks
read the locations of the current context. The edit itself is the pure ``intervene``.

References:
    Wu et al., "ReFT: Representation Finetuning for Language Models", https://arxiv.org/abs/2404.03592.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.reft import ReftIntervention, trainable_parameters
from rlcore.checks import check_float, check_ndim
from rlcore.loops.models import cache_length
from rlcore.loops.reft_data import REFT_ACTIVATIONS, ReftSpec, reft_locations

__all__ = ["ReftInterventions", "find_blocks", "make_interventions", "intervene", "COMPONENT_HOOKS",
           "reft_interventions", "ReftModel", "intervention_dtype", "intervened", "with_interventions",
           "save_interventions", "load_interventions", "REFT_FORMAT"]

# 2: "direft" keeps R orthonormal (pyreft's DiReFT); format 1's "direft" had R free, which is "nodireft".
REFT_FORMAT = 2
_SPEC_FILE, _WEIGHTS_FILE = "reft_config.json", "interventions.safetensors"


def _num_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "num_hidden_layers", None)


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[nn.Module, nn.ModuleList]:
    """``(owner, blocks)``: the decoder blocks of ``model`` and the module that holds them.

    ``path`` (``"model.layers"``) names the list; otherwise it is the ``nn.ModuleList`` of
    ``config.num_hidden_layers`` modules with the shortest name (the longest list when the
    config does not say). Raises ``TypeError`` when there is none.
    """
    if path is not None:
        owner_path, _, name = path.rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
            blocks = getattr(owner, name)
        except AttributeError as e:
            raise ValueError(f"spec.blocks: {path!r} is not a submodule of {type(model).__name__}: {e}") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"spec.blocks: {path!r} is a {type(blocks).__name__}, expected an nn.ModuleList")
        return owner, blocks
    n = _num_layers(model)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    found = [(name, m) for name, m in lists if n is None or len(m) == n]
    if not found:
        raise TypeError(f"model: no nn.ModuleList of {n} decoder blocks in {type(model).__name__}; "
                        "name it with ReftSpec(blocks='model.layers')")
    name, blocks = min(found, key=lambda x: (-len(x[1]) if n is None else 0, x[0].count("."), x[0]))
    return model.get_submodule(name.rpartition(".")[0]), blocks


class ReftInterventions(nn.ModuleDict):
    """The interventions of one ``ReftSpec``, by name (``spec.names()``), with the spec attached."""

    def __init__(self, spec: ReftSpec, modules: dict[str, nn.Module]):
        super().__init__(modules)
        self.spec = spec

    def extra_repr(self) -> str:
        return f"spec={self.spec}"


def make_interventions(spec: ReftSpec, hidden_size: int, *, zero_init: bool = False,
                       generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> ReftInterventions:
    """One ``ReftIntervention`` per name of ``spec.names()`` (per layer and position group).

    ``zero_init`` starts every one as the identity map; otherwise ``W, b`` are random (the
    paper's). Initialisation draws from ``generator`` in name order (no global RNG).

    >>> iv = make_interventions(ReftSpec(layers=(1,), positions="f2+l2", rank=2), 16)
    >>> list(iv.keys()), sum(p.numel() for p in trainable_parameters(iv.values()))
    (['layer1_first', 'layer1_last'], 132)
    """
    act = REFT_ACTIVATIONS[spec.act]
    return ReftInterventions(spec, {
        name: ReftIntervention(hidden_size, spec.rank, variant=spec.variant, dropout=spec.dropout, act=act,
                               zero_init=zero_init, generator=generator, dtype=dtype, device=device)
        for name in spec.names()})


Edit = tuple[slice, Callable[[torch.Tensor], torch.Tensor]]


def intervene(hidden: torch.Tensor, locations: torch.Tensor, edits: Sequence[Edit], *,
              offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Hidden states with ``Φ_g`` applied at the locations of each group ``g``: a new tensor.

    ``out[b, p] = Φ_g(h[b, p])`` for ``p = loc[b, j] − offset`` with ``j`` in group ``g``'s columns,
    when ``loc[b, j] ≥ 0`` and ``0 ≤ p < T``; ``out[b, t] = h[b, t]`` everywhere else. The
    locations of a row must be distinct (``reft_locations`` guarantees it).

    Args:
        hidden: ``[B, T, H]`` float, the states of one forward (columns ``offset … offset+T−1``).
        locations: ``[B, n]`` long, columns of the full sequence, ``−1`` for none.
        edits: ``(columns, Φ)`` pairs whose column slices cover ``0 … n−1`` in order; ``Φ`` maps
            ``[B, k, H] → [B, k, H]``.
        offset: first column of this forward (the KV-cache length).
    Returns:
        ``[B, T, H]``, same dtype.

    >>> h, loc = torch.zeros(1, 3, 2), torch.tensor([[2, -1]])
    >>> intervene(h, loc, [(slice(0, 2), lambda x: x + 1)])[0]
    tensor([[0., 0.],
            [0., 0.],
            [1., 1.]])

    Gradient: to ``hidden`` (unchanged positions and through ``Φ``) and to ``Φ``'s parameters.
    Implementation: invalid columns go to a scratch column ``T`` that is dropped, so one gather
    and one scatter serve every group, with no data-dependent shape.
    References: Wu et al., https://arxiv.org/abs/2404.03592 (interventions at prompt positions).
    """
    check_float("hidden", hidden)
    check_ndim("hidden", hidden, ndim=3, layout="[B, T, H]")
    check_ndim("locations", locations, ndim=2, layout="[B, n]")
    if locations.is_floating_point() or locations.dtype == torch.bool:
        raise TypeError(f"locations: expected an integer tensor [B, n], got dtype {locations.dtype}")
    B, T, H = hidden.shape
    if locations.shape[0] != B:
        raise ValueError(f"locations: expected shape [{B}, n] (B from the hidden states {list(hidden.shape)}), "
                         f"got {list(locations.shape)}")
    pos = locations.to(hidden.device) - offset
    idx = torch.where((locations.to(hidden.device) >= 0) & (pos >= 0) & (pos < T), pos, T)
    idx = idx[..., None].expand(B, idx.shape[1], H)
    ext = torch.cat([hidden, hidden.new_zeros(B, 1, H)], 1)
    picked = ext.gather(1, idx)
    edited = torch.cat([fn(picked[:, cols]) for cols, fn in edits], 1)
    return ext.scatter(1, idx, edited.to(hidden.dtype))[:, :T]


def _hook_output(block: nn.Module, edit: Callable[[torch.Tensor], torch.Tensor]):
    """Edit the block's output (``h`` or ``(h, ...)``): the residual stream after the block."""
    def hook(module, args, output):
        return (edit(output[0]), *output[1:]) if isinstance(output, tuple) else edit(output)
    return block.register_forward_hook(hook)


def _hook_input(block: nn.Module, edit: Callable[[torch.Tensor], torch.Tensor]):
    """Edit the block's input hidden states (first positional argument or ``hidden_states=``)."""
    def hook(module, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
    return block.register_forward_pre_hook(hook, with_kwargs=True)


# One installer per ``REFT_COMPONENTS`` entry, all ``(block, edit) -> hook handle``.
COMPONENT_HOOKS: dict[str, Callable] = {"block_output": _hook_output, "block_input": _hook_input}


def forward_offset(signature: inspect.Signature, args: Sequence, kwargs: dict) -> int:
    """The first column of a trunk forward called with ``args`` / ``kwargs``: the KV-cache length.

    The cache is found by type (``cache_length``), so the name it is passed under does not matter
    (``cache`` from transformers 5.24 on, ``past_key_values`` before). Without a cache, a 2-D
    attention mask longer than the input (past and current columns, the Hugging Face convention)
    gives the offset; otherwise the forward starts at column 0.
    """
    offset = cache_length(args, kwargs)
    if offset is not None:
        return offset
    bound = signature.bind_partial(*args, **kwargs).arguments
    inputs = next((bound[n] for n in ("input_ids", "inputs_embeds") if bound.get(n) is not None), None)
    mask = bound.get("attention_mask")
    if inputs is not None and isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return max(mask.shape[1] - inputs.shape[1], 0)
    return 0


def _hook_offset(owner: nn.Module, current: dict):
    """A pre-hook on the blocks' owner recording the first column of each forward in ``current``."""
    signature = inspect.signature(owner.forward)

    def hook(module, args, kwargs):
        current["offset"] = forward_offset(signature, args, kwargs)
    hook._rlcore_reft = True
    return owner.register_forward_pre_hook(hook, with_kwargs=True)


def _check_install(owner, blocks, spec: ReftSpec, interventions, locations: torch.Tensor) -> None:
    missing = sorted(set(spec.names()) - set(interventions.keys()))
    if missing:
        raise ValueError(f"interventions: missing {missing} for the spec (have {sorted(interventions.keys())})")
    bad = [i for i in spec.layers if i >= len(blocks)]
    if bad:
        raise ValueError(f"spec.layers: {bad} out of range for a model of {len(blocks)} blocks")
    if any(getattr(h, "_rlcore_reft", False) for h in owner._forward_pre_hooks.values()):
        raise RuntimeError("reft_interventions: interventions are already installed on this model")
    check_ndim("locations", locations, ndim=2, layout=f"[B, {spec.num_positions}]")
    if locations.shape[1] != spec.num_positions:
        raise ValueError(f"locations: expected shape [B, {spec.num_positions}] for positions "
                         f"{spec.positions!r}, got {list(locations.shape)}")


@contextlib.contextmanager
def reft_interventions(model: nn.Module, spec: ReftSpec, interventions: ReftInterventions,
                       locations: torch.Tensor) -> Iterator[nn.Module]:
    """Inside the block, ``model``'s forwards edit ``spec.layers`` at ``locations``; exact base outside.

    Args:
        model: a Hugging Face causal LM (or any model whose blocks ``find_blocks`` finds).
        spec: the ``ReftSpec`` the interventions were made for.
        interventions: ``make_interventions(spec, ...)`` (names ``spec.names()``).
        locations: ``[B, n]`` long (``INTERVENTION_LOCATIONS``); every forward inside must have
            ``B`` rows (repeat them for ``num_return_sequences``).
    Yields:
        ``model`` itself.

    Raises ``RuntimeError`` when interventions are already installed on ``model`` (nesting would
    edit twice), ``ValueError`` for a layer index out of range, a missing intervention or
    locations of the wrong width. The hooks are removed on exit, also after an exception.
    """
    owner, blocks = find_blocks(model, spec.blocks)
    _check_install(owner, blocks, spec, interventions, locations)
    current = {"offset": 0}
    install = COMPONENT_HOOKS[spec.component]

    def edit_of(layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        edits = [(cols, interventions[f"layer{layer}_{g}"]) for g, cols in spec.groups]
        return lambda h: intervene(h, locations, edits, offset=current["offset"])

    handles = [_hook_offset(owner, current)]
    try:
        handles += [install(blocks[i], edit_of(i)) for i in spec.layers]
        yield model
    finally:
        for h in handles:
            h.remove()


class ReftModel(nn.Module):
    """A frozen causal LM and its interventions, usable wherever a Hugging Face model is.

    ``ReftModel(model, spec)`` makes new interventions (``zero_init``, ``generator`` as in
    ``make_interventions``), ``ReftModel(model, interventions=iv)`` wraps existing ones. It
    freezes ``model`` (``requires_grad_(False)``); give an optimiser ``trainable_parameters()``
    (the wrapper's ``parameters()`` include the base's, frozen).

    - ``forward(..., intervention_locations=loc)`` runs ``model(...)`` inside
      ``reft_interventions``; without locations it is the base model.
    - ``generate(...)``: the input of generation is the prompt, so without explicit locations they
      are computed from its ``attention_mask`` (``prompt_kwargs``) and repeated for
      ``num_return_sequences``; only prompt positions are edited (module doc). The decode loop
      (``generate_rollout(engine="loop")``) gets the same locations from ``prompt_kwargs``.
    - ``get_decoder`` / ``get_output_embeddings`` / ``config`` are the base model's, so
      ``rlcore.loops.score`` works on the wrapper: inside ``intervened`` (or ``intervene``) its
      forwards are edited, outside they are the base model's.

    Under FSDP2 (``loops.recipe.shard_models``) the base model is sharded and the interventions
    stay whole on every rank (their gradients summed by ``update``); the wrapper's forwards reach
    the base through its sharded root (``calls_through``).
    """

    calls_through = "model"  # loops.dist.sharded_root

    def __init__(self, model: nn.Module, spec: ReftSpec | None = None, interventions: ReftInterventions | None = None,
                 *, zero_init: bool = False, generator: torch.Generator | None = None):
        super().__init__()
        if interventions is None and spec is None:
            raise ValueError("ReftModel: pass a spec (new interventions) or interventions (with their spec)")
        if interventions is not None and spec is not None and spec != interventions.spec:
            raise ValueError(f"spec: {spec} differs from the interventions' own spec {interventions.spec}")
        model.requires_grad_(False)
        if interventions is None:
            weight = next(model.parameters())
            interventions = make_interventions(spec, model.config.hidden_size, zero_init=zero_init, generator=generator,
                                               dtype=intervention_dtype(model), device=weight.device)
        self.model, self.interventions = model, interventions

    @property
    def spec(self) -> ReftSpec:
        return self.interventions.spec

    @property
    def config(self):
        return self.model.config

    def get_decoder(self) -> nn.Module:
        return self.model.get_decoder()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def intervene(self, locations: torch.Tensor | None):
        """The context of ``reft_interventions`` at ``locations`` (a no-op context for ``None``)."""
        if locations is None:
            return contextlib.nullcontext(self.model)
        return reft_interventions(self.model, self.spec, self.interventions, locations)

    def forward(self, *args, intervention_locations: torch.Tensor | None = None, **kwargs):
        with self.intervene(intervention_locations):
            return self.model(*args, **kwargs)

    def prompt_kwargs(self, prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"intervention_locations": loc}`` for a forward over prompts ``prompt_mask [B, P]``.

        The decode loop (``loops.engines.sample_responses``) passes these to its prefill forward,
        so sampled responses see the interventions exactly as ``generate`` and a rescoring do.
        """
        first, last = self.spec.counts
        return {"intervention_locations": reft_locations(prompt_mask.bool(), first_n=first, last_n=last)}

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 intervention_locations: torch.Tensor | None = None, **kwargs):
        if intervention_locations is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
            intervention_locations = self.prompt_kwargs(mask)["intervention_locations"]
        loc = intervention_locations.repeat_interleave(kwargs.get("num_return_sequences") or 1, 0)
        with self.intervene(loc):
            return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return trainable_parameters(self.interventions.values())

    def save(self, directory: str | Path) -> Path:
        return save_interventions(directory, self.spec, self.interventions)

    @classmethod
    def load(cls, model: nn.Module, directory: str | Path) -> ReftModel:
        weight = next(model.parameters())
        _, interventions = load_interventions(directory, device=weight.device)
        return cls(model, interventions=interventions)


def intervention_dtype(model: nn.Module) -> torch.dtype:
    """The parameters' dtype for interventions on ``model``: its own, at least float32.

    ``ReftIntervention`` computes in its parameters' dtype and returns the edited state in the
    model's, so float32 parameters on a float64 model would round the edited positions to float32.
    """
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


# --- the hooks of the recipes --------------------------------------------------------------------
def intervened(state, batch: TensorDictBase, *, model: str = "policy"):
    """The context in which ``state.model(model)`` is the ReFT policy for ``batch``'s rows.

    The interventions are those of a ``ReftModel`` policy, or ``state.models["interventions"]``
    on a plain policy; a no-op context when there are none, so a recipe can wrap its policy
    forwards unconditionally. Locations: ``batch[INTERVENTION_LOCATIONS]``, for a preference batch
    the chosen then the rejected ones (the ``[2B]`` rows of ``concatenated_forward``).
    """
    policy = state.model(model)
    if isinstance(policy, ReftModel):
        base, interventions = policy.model, policy.interventions
    elif "interventions" in state.models:
        base, interventions = policy, state.models["interventions"]
    else:
        return contextlib.nullcontext(policy)
    if K.CHOSEN in batch.keys():
        loc = torch.cat([batch.get((K.CHOSEN, K.INTERVENTION_LOCATIONS)),
                         batch.get((K.REJECTED, K.INTERVENTION_LOCATIONS))])
    else:
        loc = batch.get(K.INTERVENTION_LOCATIONS)
    return reft_interventions(base, interventions.spec, interventions, loc)


def with_interventions(loss_fn: Callable) -> Callable:
    """``loss_fn(state, batch, **kw)`` run inside ``intervened(state, batch)``: any recipe's
    ``update`` loss closure becomes its ReFT version (the policy forwards happen inside it)."""
    @functools.wraps(loss_fn)
    def wrapped(state, batch, **kwargs):
        with intervened(state, batch):
            return loss_fn(state, batch, **kwargs)
    return wrapped


def save_interventions(directory: str | Path, spec: ReftSpec, interventions: ReftInterventions) -> Path:
    """Write ``reft_config.json`` (spec, hidden size, dtype) and ``interventions.safetensors``.

    No pickle: the weights are the interventions' ``state_dict`` (for LoReFT the orthogonal
    parametrisation's own tensors, so loading reproduces ``R`` bit for bit).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in interventions.state_dict().items()}
    first = interventions[spec.names()[0]]
    meta = {"format": REFT_FORMAT, "spec": spec.to_dict(), "hidden_size": first.rotation.shape[1],
            "dtype": str(first.bias.dtype).removeprefix("torch.")}
    save_file(state, str(directory / _WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / _SPEC_FILE).write_text(json.dumps(meta, indent=1))
    return directory


def load_interventions(directory: str | Path, *, device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None) -> tuple[ReftSpec, ReftInterventions]:
    """``(spec, interventions)`` saved by ``save_interventions`` (strict: every tensor must fit).
    A format-1 folder's ``direft`` (``R`` unconstrained) loads as ``nodireft``, the same map."""
    directory = Path(directory)
    meta = json.loads((directory / _SPEC_FILE).read_text())
    if meta.get("format") not in (1, REFT_FORMAT):
        raise ValueError(f"{directory / _SPEC_FILE}: format {meta.get('format')!r}, expected {REFT_FORMAT} (or 1)")
    spec_dict = dict(meta["spec"])
    if meta["format"] == 1 and spec_dict.get("variant") == "direft":
        spec_dict["variant"] = "nodireft"
    spec = ReftSpec.from_dict(spec_dict)
    stored = getattr(torch, str(meta.get("dtype")), None)
    if dtype is None and not (isinstance(stored, torch.dtype) and stored.is_floating_point):
        raise ValueError(f"{directory / _SPEC_FILE}: dtype: expected a floating-point torch dtype name "
                         f"(e.g. 'float32'), got {meta.get('dtype')!r}")
    dtype = dtype or stored
    interventions = make_interventions(spec, meta["hidden_size"], dtype=dtype, device=device)
    state = load_file(str(directory / _WEIGHTS_FILE), device=str(device or "cpu"))
    interventions.load_state_dict(state, strict=True)
    return spec, interventions

