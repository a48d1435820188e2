"""The ``rlcore`` command: ``demo``, ``train RECIPE``, ``eval RECIPE``, ``export RECIPE``, ``plan RECIPE``, ``recipes``.

``rlcore train RECIPE [--config FILE.yaml] [--FIELD VALUE ...]`` runs a recipe of ``loops.recipes.RECIPES``;
its options are the fields of the recipe's ``Config`` (``rlcore train RECIPE --help`` lists them
with their defaults and documentation). Values given on the command line override the YAML,
which overrides the defaults; unknown fields are an error that lists the valid ones. ``--async``
(GRPO, RLOO, PPO, online DPO) runs the recipe with ``loops.scale.async_rl.train_async``: generation in
its own process at most ``--max_lag`` policy versions behind, ``--is_clip`` capping the importance
weights.

``rlcore eval RECIPE --checkpoint DIR`` evaluates a saved policy on the recipe's held-out split,
against the policy its run started from (the reference for KL); a recipe whose state is not a
language-model policy (``ddpo``, the ``reft`` recipes) rebuilds it with its ``Recipe.checkpoint_state``.

``rlcore export RECIPE --checkpoint DIR --out DIR`` writes a checkpoint's policy as a plain
``from_pretrained`` folder with its tokenizer; a LoRA policy's adapter is merged into its base
(``loops.lora.export_merged``).

``rlcore plan RECIPE --model NAME_OR_PATH [--world-size 8 --strategy fsdp2 --device-memory 80GB ...]``
prints the memory model's per-rank bytes by phase and component (``loops.plan``), for a built-in
shape (``loops.plan.SHAPES``), a ``from_pretrained`` folder's ``config.json`` or ``tiny-llama``
(``--hidden-size``, ``--num-layers``, ``--num-heads``); with ``--device-memory``, whether it fits and,
if not, the nearby settings that do. Its options are the fields of ``loops.plan.PlanSettings``.

A checkpoint is data: ``eval`` and ``export`` take its stored hyper-parameters (sizes, lengths,
sampling) but every setting that runs code, opens a path or widens trust (reward functions,
``trust_remote_code``, model / dataset locations, ``init_from``, devices) comes from this command
line and its ``--config`` only; a stored one that differs is reported on stderr, not obeyed
(``loops.checkpoint_config``). ``--init_from`` names the checkpoint the evaluated run started
from: the reference for KL, and the base of an adapter checkpoint whose run started from one.

A fault of the settings or the data (an unknown field, a value out of range, a config file that is
not YAML, a dataset row that cannot be read, a missing file) is printed as one message naming the
field or row and what is allowed, with exit status 2 and no traceback; ``--traceback`` (or
``RLCORE_TRACEBACK=1``) shows the traceback. An error raised once the run has started is shown
with its traceback (``main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.loops.recipes import RECIPES, Recipe

__all__ = ["field_docs", "main"]


def field_docs(cls: type) -> dict[str, str]:
    """``field -> its --help line``, generated from its declaration (``loops.settings.describe``: the
    help text, units and range declared on the field in its section)."""
    from rlcore.loops.settings import describe

    return {f.name: describe(cls, f.name) for f in dataclasses.fields(cls)}


def _hinted_trl_names(config_cls: type) -> dict[str, list[str]]:
    """``field -> TRL's names for it`` of a recipe without a TRL table of its own (online DPO, DDPO, the
    ReFT recipes): the names the other recipes' tables translate to a field of this config, as hints."""
    from rlcore.loops.config import trl_hints

    fields = {f.name for f in dataclasses.fields(config_cls)}
    out: dict[str, list[str]] = {}
    for name, targets in trl_hints().items():
        for field in targets:
            if field in fields and field != name:
                out.setdefault(field, []).append(name)
    return out


def _recipe_parser(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """The ``--config`` option, one ``--FIELD`` per field of ``config_cls`` (its documentation, the
    TRL names that set it, its default) and, for a recipe with a TRL table (``loops.trl_config``),
    one ``--NAME`` per TRL name: translated ones listed with what they set, the others accepted
    quietly so that ``load_config`` answers them (their value allowed, or the reason they are refused)."""
    from rlcore.loops.trl_config import Accept, table_for, trl_names_by_field

    parser.add_argument("--config", type=Path, help="a YAML file of fields (configs/<recipe>.yaml)")
    docs = field_docs(config_cls)
    found = table_for(config_cls)
    recipe, table = found if found else ("", {})
    trl = trl_names_by_field(recipe) if table else _hinted_trl_names(config_cls)
    group = parser.add_argument_group("fields of the recipe's Config (YAML keys, or --flags here)")
    fields = [f.name for f in dataclasses.fields(config_cls)]
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        names = f" (TRL: {', '.join(trl[f.name])})" if f.name in trl else ""
        group.add_argument(f"--{f.name}", dest=f"field_{f.name}", default=None, metavar="VALUE",
                           help=f"{docs.get(f.name, '')}{names} [default: {default!r}]".strip())
    if not table:
        return
    group = parser.add_argument_group("TRL's names (translated with TRL's meaning; docs/from_trl.md lists every one)")
    for name, entry in table.items():
        if name in fields:
            continue
        shown = isinstance(entry, Accept)
        group.add_argument(f"--{name}", dest=f"field_{name}", default=None, metavar="VALUE",
                           help=f"→ {', '.join(entry.to)}: {entry.note}" if shown else argparse.SUPPRESS)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The fields the caller set: the ``--config`` YAML, then the ``--field`` flags (both read by
    ``loops.config``'s bounded YAML loader)."""
    from rlcore.loops.config import read_config_file

    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(read_config_file(args.config))
    values.update({k[len("field_"):]: _parse_value(v, f"--{k[len('field_'):]}") for k, v in vars(args).items()
                   if k.startswith("field_") and v is not None})
    return values


def _config(recipe: Recipe, args: argparse.Namespace, base: dict[str, Any] | None = None,
            forced: dict[str, Any] | None = None) -> Any:
    """The recipe's ``Config``: defaults < ``base`` < the ``--config`` YAML < ``--field`` flags < ``forced``.
    The caller's TRL names are read before ``base`` joins (a stored ``lr`` is no conflict with ``--learning_rate``)."""
    from rlcore.loops.config import load_config, trl_translated

    values = {**(base or {}), **trl_translated(recipe.config, _given(args)), **(forced or {})}
    return load_config(recipe.config, None, values)


def _parse_value(text: str, where: str = "a flag") -> Any:
    """Command-line text -> a YAML scalar (so ``--lr 1e-4``, ``--packing true``, ``--top_k null`` work),
    read by ``loops.config.parse_yaml`` (bounded); ``where`` names the flag in its errors."""
    from rlcore.loops.config import parse_yaml

    return parse_yaml(text, where)


def _train(args: argparse.Namespace) -> int:
    from rlcore.loops.dist import init_distributed

    init_distributed()  # joins torchrun's process group; a no-op in one process
    recipe = RECIPES[args.recipe]
    config = _config(recipe, args)
    if args.run_async:
        from rlcore.loops.scale.async_rl import train_async

        _, history = train_async(config, max_lag=args.max_lag, is_clip=args.is_clip, callbacks=[args.started])
    else:
        _, history = recipe.train(config, callbacks=[args.started])
    if history:  # strict JSON: a NaN or infinite metric is printed as null
        print(json.dumps({"final": _strict_json(history[-1])}, indent=None, allow_nan=False))
    return 0


def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by ``None``, through dicts and lists."""
    if isinstance(value, float):
        return value if value - value == 0 else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _saved_run(recipe: Recipe, args: argparse.Namespace) -> tuple[Path, dict[str, Any], Any]:
    """The checkpoint ``--checkpoint`` names (a run directory: its latest; its files are verified
    against its manifest where they are loaded); the hyper-parameters of its stored config that the
    recipe's ``Config`` has; and the caller's own ``Config`` (defaults < YAML < flags).

    The stored config is data (``loops.checkpoint_config``): its code, paths, devices and
    permissions are never taken; each such stored value that differs from the caller's is reported
    on stderr."""
    from rlcore.loops.checkpoint import latest_checkpoint
    from rlcore.loops.checkpoint_config import data_settings, report_ignored, stored_config
    from rlcore.loops.config import config_dict

    path = Path(args.checkpoint)
    if not (path / "trainer_state.json").exists():  # a run directory: its latest checkpoint
        path = latest_checkpoint(path) or path
    caller = _config(recipe, args)
    fields = [f.name for f in dataclasses.fields(recipe.config)]
    start, ignored = data_settings(stored_config(path), fields, config_dict(caller), _given(args))
    report_ignored(path / "config.json", ignored, command=f"rlcore {args.command}")
    return path, start, caller


def _eval(args: argparse.Namespace) -> int:
    from rlcore.loops.models import make_reference
    from rlcore.loops.recipe import build_policy, check_tiny_fits, checkpoint_model_dir, require_held_out
    from rlcore.loops.state import init_state

    recipe = RECIPES[args.recipe]
    path, start, caller = _saved_run(recipe, args)
    if recipe.checkpoint_state is not None:  # recipes whose state is not a language-model policy
        config = _config(recipe, args, start, {"resume": False})
        require_held_out(config)  # a run that held nothing out (num_eval 0): before any model
        state = recipe.checkpoint_state(config, path)
    else:
        # the reference for KL: the policy the run started from, as the caller names it (--init_from,
        # which is also the base of an adapter checkpoint whose run started from a checkpoint), or a fresh init
        base_from = caller.init_from
        config = _config(recipe, args, start, {"init_from": str(path), "resume": False})
        require_held_out(config)
        policy, _ = build_policy(config, task=recipe.model_task, base_from=base_from)  # its weights checked against their headers
        # a fresh reference is built from the stored sizes: first checked against the checkpoint's own weights
        ref_config = _config(recipe, args, start, {"resume": False})
        check_tiny_fits(ref_config, checkpoint_model_dir(path), recipe.model_task)
        reference, _ = build_policy(ref_config, task=recipe.model_task)
        state = init_state({"policy": policy, "ref": make_reference(reference)}, seed=config.seed)
    args.started.on_start(state)
    print(json.dumps(recipe.evaluate(state, config), indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlcore.loops.checkpoint_shards import is_sharded_folder, plain_folder
    from rlcore.loops.lora import export_merged
    from rlcore.loops.recipe import build_policy, checkpoint_model_dir

    recipe = RECIPES[args.recipe]
    if recipe.checkpoint_state is not None:
        raise SystemExit(f"rlcore export: the {args.recipe} recipe's checkpoints are not a language-model policy; "
                         "load them with its checkpoint_state")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"rlcore export: --out {out} exists and is not empty")
    path, start, caller = _saved_run(recipe, args)
    model_dir = checkpoint_model_dir(path)
    if is_sharded_folder(model_dir):  # full weights written by the ranks: gathered one file at a time
        args.started.on_start(None)
        plain_folder(model_dir, out)
        print(json.dumps({"exported": str(out), "from": str(path)}))
        return 0
    # the checkpoint's policy as plain weights: an adapter merged into its base, no new adapter
    config = _config(recipe, args, start, {"init_from": str(path), "resume": False, "use_peft": False,
                                           "gradient_checkpointing": False, "device": "cpu"})
    model, tokenizer = build_policy(config, task=recipe.model_task, base_from=caller.init_from)
    args.started.on_start(None)
    export_merged(model, tokenizer, out)
    print(json.dumps({"exported": str(out), "from": str(path)}))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rlcore.loops import demo

    return demo.main(args)


def _plan_parser(sub: Any) -> None:
    """``rlcore plan``: the recipe, the model, one ``--field`` per field of ``loops.plan.PlanSettings`` (dashes or
    underscores), ``--device-memory``."""
    from rlcore.loops.plan import RECIPE_MODELS, SHAPES, PlanSettings

    p = sub.add_parser("plan", help="predict the per-rank peak memory of a recipe's run (rlcore.loops.plan)",
                       description="Per-rank memory by phase and component; which settings fit a device.")
    p.add_argument("recipe", choices=sorted(RECIPE_MODELS), help="which recipe")
    p.add_argument("--model", default="tiny-llama",
                   help=f"a built-in shape ({', '.join(sorted(SHAPES))}), a from_pretrained folder or its config.json, "
                        "or tiny-llama (sized by --hidden-size, --num-layers, --num-heads) [default: tiny-llama]")
    for name, default in (("hidden_size", 64), ("num_layers", 2), ("num_heads", 4)):
        p.add_argument(f"--{name.replace('_', '-')}", f"--{name}", dest=name, type=int, default=default,
                       help=f"tiny-llama's {name} [default: {default}]")
    p.add_argument("--device-memory", "--device_memory", dest="device_memory", default=None,
                   help="bytes per device, e.g. 80GB (10^9) or 80GiB (2^30): says whether the plan fits, and if not, "
                        "which nearby settings do")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    group = p.add_argument_group("settings (loops.plan.PlanSettings)")
    hints = typing.get_type_hints(PlanSettings)
    for f in dataclasses.fields(PlanSettings):
        if f.name == "recipe":
            continue
        flags = dict.fromkeys([f"--{f.name.replace('_', '-')}", f"--{f.name}"])
        kwargs: dict[str, Any] = {"dest": f"plan_{f.name}", "default": f.default,
                                  "help": f"{f.metadata['help']} [default: {f.default!r}]"}
        if hints[f.name] in (bool, bool | None):
            kwargs.update(action=argparse.BooleanOptionalAction)  # --gradient-checkpointing, --no-sharded-load
        elif f.name == "lora_target_modules":
            kwargs.update(nargs="+", metavar="MODULE")
        elif f.name == "overhead":
            kwargs.update(metavar="BYTES")
        else:
            kwargs.update(type=type(f.default) if f.default is not None and f.name != "lora_dropout" else
                          (float if f.name == "lora_dropout" else _int_or_text(f.name)), metavar="VALUE")
        group.add_argument(*flags, **kwargs)


def _int_or_text(name: str) -> Any:
    """An argparse type for a field whose default is None: an integer, or text for the string fields."""
    return str if name in ("mixed_precision", "fsdp_param_dtype", "ref_device", "reward_device") else int


def _plan(args: argparse.Namespace) -> int:
    from rlcore.loops.plan import PlanSettings, fitting, format_bytes, parse_bytes, plan_memory, shape_of

    values = {k[len("plan_"):]: v for k, v in vars(args).items() if k.startswith("plan_")}
    values["overhead"] = parse_bytes(values["overhead"], "overhead")
    if values["lora_target_modules"] is not None:
        values["lora_target_modules"] = tuple(values["lora_target_modules"])
    settings = PlanSettings(recipe=args.recipe, **values)
    model = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads} \
        if args.model == "tiny-llama" else args.model
    shape = shape_of(model)
    memory = None if args.device_memory is None else parse_bytes(args.device_memory)
    plan = plan_memory(shape, settings)
    if args.json:
        print(json.dumps({"shape": dataclasses.asdict(plan.shape), "settings": dataclasses.asdict(settings),
                          "bytes": plan.bytes, "peak": plan.peak, "peak_phase": plan.peak_phase, "host": plan.host,
                          "fits": None if memory is None else plan.fits(memory)}, indent=1))
        return 0
    print(plan.table(memory))
    if memory is None or plan.fits(memory):
        return 0
    found = fitting(shape, settings, memory)
    if found:
        _print_fitting(f"Settings that fit in {format_bytes(memory)} (fewest changes first)", found)
        return 0
    print(f"\nNo nearby settings fit in {format_bytes(memory)} (tried gradient checkpointing, smaller micro-batches "
          "and generation batches, bfloat16, fsdp2, CPU offload, LoRA).")
    if plan.peak_phase == "load" and settings.strategy == "fsdp2" and not settings.sharded_load:
        later = fitting(shape, dataclasses.replace(settings, sharded_load=True), memory)
        if later:
            _print_fitting("The load is the peak: each rank builds the policy whole before sharding it. Loaded "
                           "sharded from a from_pretrained folder (--sharded-load), these would fit", later)
    return 0


def _print_fitting(title: str, found: list) -> None:
    from rlcore.loops.plan import format_bytes

    print(f"\n{title}:\n\n| changes | peak per rank | phase |\n| --- | ---: | --- |")
    for changes, fit in found:
        said = ", ".join(f"{k}={v}" for k, v in changes.items()) or "(none)"
        print(f"| {said} | {format_bytes(fit.peak)} | {fit.peak_phase} |")


def _recipes(args: argparse.Namespace) -> int:
    for name, recipe in RECIPES.items():
        print(f"{name:12s} {recipe.doc}")
    return 0


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from rlcore.loops import demo

    demo.add_arguments(sub.add_parser("demo", help="the built-in offline post-training demo",
                                      description=demo.__doc__.splitlines()[0]))
    sub.add_parser("recipes", help="list the recipes")
    _plan_parser(sub)
    # Recipe options depend on the recipe: only the one named on the command line adds its fields.
    commands = (("train", "run a recipe"), ("eval", "evaluate a checkpoint of a recipe"),
                ("export", "write a checkpoint's policy as a plain from_pretrained folder (a LoRA adapter merged)"))
    recipe = next((a for a in argv[1:] if not a.startswith("-")), None) if argv[:1] in [[c] for c, _ in commands] \
        else None
    for command, help_text in commands:
        p = sub.add_parser(command, help=help_text)
        p.add_argument("recipe", choices=sorted(RECIPES), help="which recipe")
        # read (and removed) by main before parsing; listed here for --help
        p.add_argument("--traceback", action="store_true",
                       help="show the traceback of a settings or data error (also RLCORE_TRACEBACK=1)")
        if command in ("eval", "export"):
            p.add_argument("--checkpoint", required=True, help="a checkpoint directory or a run directory")
        if command == "export":
            p.add_argument("--out", required=True, help="the folder to write (new or empty)")
        elif command == "train":
            learners = ", ".join(name for name, r in RECIPES.items() if r.learn is not None)
            scale = p.add_argument_group(f"asynchronous off-policy training ({learners}; rlcore.loops.scale.async_rl)")
            scale.add_argument("--async", dest="run_async", action="store_true",
                               help="generate in a separate process, at most --max_lag policy versions behind")
            scale.add_argument("--max_lag", type=int, default=1, help="policy versions the generator may lag [default: 1]")
            scale.add_argument("--is_clip", type=float, default=None,
                               help="truncated importance weight cap (None: the loss's clipped ratio only) [default: None]")
        if recipe in RECIPES and argv[0] == command:
            _recipe_parser(p, RECIPES[recipe].config)
        else:
            p.add_argument("--config", type=Path)
    return parser


class _FirstStep:
    """A fold callback that notes the start of the first step (``on_start``): a fault raised before it
    comes from the settings or the data, one raised after it from the run."""

    def __init__(self) -> None:
        self.started = False

    def on_start(self, state: Any) -> None:
        self.started = True

    def __call__(self, state: Any, metrics: dict) -> None:
        return None


def _setting_fault(error: BaseException, started: bool) -> bool:
    """Whether ``error`` is a fault of what the user gave, to be reported as its message: a
    ``ConfigError`` at any time; before the first step (or the evaluation, or the export) also a
    ``ValueError`` (every check of a config, a dataset row, a model folder raises one), a file that
    is missing or unreadable, a checkpoint that fails its checks, a package or reward-function
    module that cannot be imported. Anything else, and any of these
    once the run has started, is a fault of the program: its traceback is shown."""
    from rlcore.loops.checkpoint_codec import CheckpointError
    from rlcore.loops.config import ConfigError

    setup = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, CheckpointError,
             ImportError)
    return isinstance(error, ConfigError) or (not started and isinstance(error, setup))


def main(argv: Sequence[str] | None = None, *, report: bool | None = None) -> int:
    """Run the ``rlcore`` command on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    With ``report`` (the default when ``argv`` is None, that is for the command itself), a fault of
    the settings or the data (``_setting_fault``: an unknown field, a bad value, a config file that
    is not YAML, a bad dataset row, a missing file) prints one line, ``rlcore COMMAND RECIPE: error:
    MESSAGE`` (the message names the field or row and what is allowed), and returns 2, as a bad
    option does; ``--traceback`` anywhere on the command line, or ``RLCORE_TRACEBACK=1``, raises it
    with its traceback instead. Without ``report`` (a caller passing ``argv`` from Python) every
    exception reaches the caller. SIGINT / SIGTERM during a run stop it at a step boundary, save it
    and print the command that resumes it (exit status 130 / 143); a Ctrl-C before the first step
    prints that nothing was saved (130)."""
    import os

    report = argv is None if report is None else report
    argv = list(sys.argv[1:] if argv is None else argv)
    show = "--traceback" in argv or os.environ.get("RLCORE_TRACEBACK", "") not in ("", "0")
    argv = [a for a in argv if a != "--traceback"]
    args = build_parser(argv).parse_args(argv)
    args.started = _FirstStep()
    handler = {"train": _train, "eval": _eval, "export": _export, "demo": _demo, "recipes": _recipes,
               "plan": _plan}[args.command]
    from rlcore.loops.fold import Interrupted
    from rlcore.loops.run_dir import interrupted_report

    where = " ".join(["rlcore", args.command, *([args.recipe] if getattr(args, "recipe", None) else [])])
    try:
        return handler(args)
    except Interrupted as stopped:  # SIGINT / SIGTERM: the run saved its last step; say how to go on
        print(interrupted_report(stopped, argv), file=sys.stderr, flush=True)
        return stopped.exit_code
    except KeyboardInterrupt:
        if not report or show:
            raise
        said = ("interrupted at once (a second signal): the step in progress was not saved" if args.started.started
                else "interrupted before the first step: nothing was saved")
        print(f"{where}: {said}", file=sys.stderr, flush=True)
        return 130
    except Exception as error:
        if not report or show or not _setting_fault(error, args.started.started):
            raise
        print(f"{where}: error: {error}\n(--traceback or RLCORE_TRACEBACK=1 shows where it was raised)",
              file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
