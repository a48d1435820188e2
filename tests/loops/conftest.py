"""Shared fixtures for tests/loops: everything offline, tiny tokenizers and models built from configs."""

import os

import pytest

# Set before any test module imports transformers / datasets / huggingface_hub (they read these
# at import time); the fixture below keeps them set for every test.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Nothing in these tests may download: the hub is switched off."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


@pytest.fixture(scope="session")
def tokenizer():
    from rlcore.loops.models import build_tokenizer
    return build_tokenizer()


@pytest.fixture(scope="session")
def small_tokenizer():
    """Characters 'a' and 'b' only (9 tokens): a random model emits EOS often."""
    from rlcore.loops.models import build_tokenizer
    return build_tokenizer(vocab="ab")


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def lm(request, tokenizer):
    """A tiny causal LM of each architecture (do not modify it in a test)."""
    from rlcore.loops.models import build_model
    return build_model(request.param, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4).eval()


STOP_SIGNALS = ("SIGINT", "SIGTERM")


def deliver_stop_signals() -> None:
    """SIGINT and SIGTERM unblocked, SIGINT's handler Python's own: what a shell gives a command. A test
    worker's signal state may have been left otherwise by a library it ran before (a process started
    with SIGINT blocked or ignored passes that on to the processes it starts)."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {getattr(signal, name) for name in STOP_SIGNALS})
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def stop_signals():
    """The test runs with :func:`deliver_stop_signals`; the worker's signal state is restored after."""
    import signal

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handler = signal.getsignal(signal.SIGINT)
    deliver_stop_signals()
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


def shell_signals() -> None:
    """``preexec_fn`` of a child that must receive SIGINT / SIGTERM as it would from a shell."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {getattr(signal, name) for name in STOP_SIGNALS})
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python installs its KeyboardInterrupt handler at start


def write_rank(out_dir, rank: int, out: dict, tensors: dict) -> None:
    """What a spawned rank hands back to its test: ``rank<r>.json`` and ``rank<r>.safetensors``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir) / f"rank{rank}.safetensors"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))


def run_ranks(worker, out_dir, world_size: int = 2) -> list[tuple[dict, dict]]:
    """``worker(out_dir)`` on ``world_size`` gloo ranks (``rlcore.loops.dist.spawn``, forkserver with
    ``rlcore.loops`` preloaded); each rank's ``(json, tensors)`` as it wrote them (:func:`write_rank`)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from rlcore.loops.dist import spawn

    spawn(worker, world_size, str(out_dir), backend="gloo", start_method="forkserver", preload=("rlcore.loops",))
    out = Path(out_dir)
    return [(json.loads((out / f"rank{r}.json").read_text()), load_file(str(out / f"rank{r}.safetensors")))
            for r in range(world_size)]


def gathered_parameters(model):
    """A model's parameters by state-dict name, FSDP2 shards gathered into full tensors (a collective on a
    sharded model), each a contiguous copy in its own dtype (a root left gathered after its forward holds
    its parameters in ``fsdp_param_dtype``, its shards in the weights' dtype)."""
    names = dict(model.named_parameters())
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().contiguous()
            for n, p in model.state_dict().items() if n in names}


def save_tiny_llama(folder):
    """The tiny Llama every sharded-loading test reads, saved as a ``from_pretrained`` folder with its tokenizer."""
    from rlcore.loops.models import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model("llama", tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def run_tensors(tensors, run, strategy):
    """The tensors a rank wrote under ``{run}/{strategy}/``, keyed by the rest of their names."""
    prefix = f"{run}/{strategy}/"
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def assert_histories_close(history, other, *, rtol, atol):
    """Two runs logged the same metrics at every step, each within ``rtol`` / ``atol``."""
    assert len(history) == len(other)
    for row, theirs in zip(history, other, strict=True):
        assert row.keys() == theirs.keys()
        for k in row:
            assert theirs[k] == pytest.approx(row[k], rel=rtol, abs=atol), k
