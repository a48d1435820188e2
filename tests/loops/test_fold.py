"""fold: step counting, callback order and protocol, early stop, resume skip, to_floats."""

import dataclasses
import os
import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlcore.loops.fold import STOP, every, fold, follow_live_memory, stop_when, to_floats
from rlcore.loops.state import TrainState, advance, copy_generator, init_state, with_transforms
from rlcore.testing import assert_pure


@dataclasses.dataclass(frozen=True)
class S:
    step: int = 0
    total: int = 0
    seen: tuple = ()


def add(state, x):
    """A step: accumulates the items it sees; metrics as a TensorDict of 0-d tensors."""
    new = dataclasses.replace(state, total=state.total + x, seen=state.seen + (x,))
    return new, TensorDict({"x": torch.tensor(float(x)), "total": torch.tensor(new.total)}, batch_size=[])


class Recorder:
    def __init__(self, name, log, ret=None):
        self.name, self.log, self.ret = name, log, ret

    def on_start(self, state):
        self.log.append((self.name, "start", state.step))

    def __call__(self, state, metrics):
        self.log.append((self.name, state.step, dict(metrics)))
        return self.ret(state, metrics) if self.ret else None

    def on_end(self, state):
        self.log.append((self.name, "end", state.step))


# --- step counting -------------------------------------------------------------------------------
def test_num_steps_is_the_target_of_state_step():
    state, hist = fold(add, S(), range(1, 11), num_steps=3)
    assert state.step == 3 and state.seen == (1, 2, 3) and state.total == 6
    assert hist == [{"x": 1.0, "total": 1.0}, {"x": 2.0, "total": 3.0}, {"x": 3.0, "total": 6.0}]


def test_runs_until_the_source_is_exhausted_and_consumes_no_extra_item():
    state, hist = fold(add, S(), [5, 6], num_steps=None)
    assert state.step == 2 and len(hist) == 2
    it = iter(range(10))
    fold(add, S(), it, num_steps=4)
    assert next(it) == 4  # exactly num_steps items were taken from the iterator


def test_input_state_is_not_changed():
    s0 = S()
    state, _ = fold(add, s0, [1, 2, 3])
    assert s0 == S() and state is not s0


def test_fold_counts_items_even_if_step_forgets():
    state, _ = fold(lambda s, x: (s, {}), S(step=0), [1, 2, 3])
    assert state.step == 3


# --- callbacks -----------------------------------------------------------------------------------
def test_callbacks_run_in_order_with_hooks_once():
    log = []
    fold(add, S(), [1, 2], callbacks=[Recorder("a", log), Recorder("b", log)])
    assert [e[:2] for e in log] == [("a", "start"), ("b", "start"), ("a", 1), ("b", 1), ("a", 2), ("b", 2),
                                    ("a", "end"), ("b", "end")]
    assert log[2][2] == {"x": 1.0, "total": 1.0}  # plain floats, not tensors


def test_callback_mapping_is_merged_for_later_callbacks_and_history():
    log = []
    evaluate = Recorder("eval", log, ret=lambda s, m: {"eval/acc": torch.tensor(0.5)})
    _, hist = fold(add, S(), [1, 2], callbacks=[evaluate, Recorder("log", log)])
    assert log[3] == ("log", 1, {"x": 1.0, "total": 1.0, "eval/acc": 0.5})
    assert hist[1]["eval/acc"] == 0.5


def test_early_stop_finishes_the_step_then_ends():
    log = []
    stopper = stop_when(lambda s, m: m["total"] >= 3)
    state, hist = fold(add, S(), range(1, 100), callbacks=[stopper, Recorder("log", log)])
    assert state.step == 2 and len(hist) == 2
    assert ("log", 2) in [e[:2] for e in log] and log[-1] == ("log", "end", 2)


def test_bad_callback_return_and_bad_state():
    with pytest.raises(ValueError, match="returned 'halt'"):
        fold(add, S(), [1], callbacks=[lambda s, m: "halt"])
    with pytest.raises(TypeError, match="field 'step'"):
        fold(add, {"step": 0}, [1])


def test_every_fires_on_multiples_and_at_end_with_last_metrics():
    calls = []
    cb = every(2, lambda s, m: calls.append((s.step, m.get("x"))), at_end=True)
    fold(add, S(), [1, 2, 3, 4, 5], callbacks=[cb])
    assert calls == [(2, 2.0), (4, 4.0), (5, 5.0)]
    calls.clear()
    fold(add, S(), [1, 2, 3, 4], callbacks=[every(2, lambda s, m: calls.append(s.step), at_end=True)])
    assert calls == [2, 4]  # the last step was already a multiple: not called twice
    with pytest.raises(ValueError, match="n: expected a positive int"):
        every(0, print)


def test_every_forwards_hooks():
    log = []
    fold(add, S(), [1, 2, 3], callbacks=[every(2, Recorder("r", log))])
    assert [e[:2] for e in log] == [("r", "start"), ("r", 2), ("r", "end")]


# --- resume -------------------------------------------------------------------------------------
def test_resume_skips_consumed_items_and_matches_a_straight_run():
    items = [3, 1, 4, 1, 5, 9, 2, 6]
    straight, hist = fold(add, S(), items, num_steps=6)
    half, h1 = fold(add, S(), items, num_steps=4)
    resumed, h2 = fold(add, half, items, num_steps=6)  # same arguments, continues the run
    assert resumed == straight and h1 + h2 == hist
    assert resumed.seen == (3, 1, 4, 1, 5, 9)


def test_resume_with_a_callable_source_starts_at_the_position():
    starts = []

    def source(start):
        starts.append(start)
        return iter(range(start, 100))

    state, _ = fold(add, S(step=5), source, num_steps=8)
    assert starts == [5] and state.seen == (5, 6, 7)


def test_resume_with_a_source_shorter_than_the_position_raises():
    with pytest.raises(ValueError, match="consumed 5 items .* holds only 3"):
        fold(add, S(step=5), [1, 2, 3], num_steps=8)
    state, hist = fold(add, S(step=3), [1, 2, 3])  # resuming a finished run: nothing to do
    assert state.step == 3 and hist == []


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 8), m=st.integers(0, 8))
def test_split_runs_equal_one_run(n, m):
    items = list(range(2, 30))
    straight, hist = fold(add, S(), items, num_steps=n + m)
    first, h1 = fold(add, S(), items, num_steps=n)
    second, h2 = fold(add, first, items, num_steps=n + m)
    assert second == straight and h1 + h2 == hist


# --- to_floats ----------------------------------------------------------------------------------
def test_to_floats_golden_nested_and_mixed():
    td = TensorDict({"loss": torch.tensor(0.25, dtype=torch.float64), "n": torch.tensor(3),
                     "flag": torch.tensor(True), "one": torch.tensor([2.5]),
                     "chosen": TensorDict({"logps": torch.tensor(-1.5)}, [])}, batch_size=[])
    out = assert_pure(to_floats, td)
    assert out == {"loss": 0.25, "n": 3.0, "flag": 1.0, "one": 2.5, "chosen/logps": -1.5}
    assert all(type(v) is float for v in out.values())
    assert to_floats({"a": 1, "b": torch.tensor(2.0, dtype=torch.bfloat16)}) == {"a": 1.0, "b": 2.0}
    assert to_floats({}) == {}


def test_to_floats_keeps_float64_precision():
    x = 1.0 + 2.0 ** -40
    assert to_floats({"x": torch.tensor(x, dtype=torch.float64)})["x"] == x


def test_to_floats_rejects_non_scalars_naming_the_key():
    with pytest.raises(ValueError, match=r"metrics\['per_token'\].*got shape \[2, 3\]"):
        to_floats({"per_token": torch.zeros(2, 3)})


# --- state helpers ------------------------------------------------------------------------------
def test_state_helpers():
    model = torch.nn.Linear(2, 1)
    s = init_state(model, seed=7)
    assert s.model() is model and s.rng.initial_seed() == 7 and s.step == 0
    with pytest.raises(KeyError, match="'ref' is not in the state; it has \\['policy'\\]"):
        s.model("ref")
    s2 = advance(s, samples_seen=4, tokens_seen=torch.tensor(10))
    assert (s2.samples_seen, s2.tokens_seen, s.samples_seen) == (4, 10, 0)
    with pytest.raises(ValueError, match="unknown counters \\['tokens'\\]"):
        advance(s, tokens=1)
    s3 = with_transforms(s, kl=(torch.tensor(0.1),))
    assert "kl" in s3.transforms and "kl" not in s.transforms
    g = copy_generator(s.rng)
    assert torch.equal(g.get_state(), s.rng.get_state()) and g is not s.rng
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.step = 3  # type: ignore[misc]
    assert STOP == "stop" and isinstance(s, TrainState)


# --- signals -----------------------------------------------------------------------------------------
class EndRecorder:
    def __init__(self):
        self.ends = []

    def __call__(self, state, metrics):
        return None

    def on_end(self, state):
        self.ends.append(state.step)


def signalling_step(signum, at_step, times=1):
    import os

    def step(state, x):
        if state.step == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return dataclasses.replace(state, total=state.total + x), {"x": x}
    return step


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_fold_after_the_step_in_progress(name, stop_signals):
    import signal

    from rlcore.loops.fold import Interrupted

    signum = getattr(signal, name)
    before, recorder = signal.getsignal(signum), EndRecorder()
    with pytest.raises(Interrupted) as stopped:
        fold(signalling_step(signum, at_step=1), S(), range(10), num_steps=10, callbacks=[recorder])
    assert recorder.ends == [2]  # step 2 finished, then every on_end (a Checkpointer saves there)
    assert (stopped.value.step, stopped.value.exit_code, stopped.value.at_once) == (2, 128 + signum, False)
    assert str(stopped.value) == f"stopped by {name} after step 2 of 10; no run_dir: nothing saved"
    assert isinstance(stopped.value, KeyboardInterrupt)
    assert signal.getsignal(signum) is before  # restored


def test_a_second_signal_stops_at_once_and_a_signal_in_the_last_step_ends_normally(stop_signals):
    import signal

    from rlcore.loops.fold import Interrupted

    recorder = EndRecorder()
    with pytest.raises(Interrupted) as stopped:
        fold(signalling_step(signal.SIGINT, at_step=1, times=2), S(), range(10), num_steps=10, callbacks=[recorder])
    assert stopped.value.at_once and stopped.value.step == 1 and recorder.ends == []
    assert str(stopped.value).startswith("stopped at once by a second SIGINT during step 2 of 10 (lost)")
    state, history = fold(signalling_step(signal.SIGINT, at_step=2), S(), range(10), num_steps=3)
    assert state.step == 3 and len(history) == 3  # nothing left to stop: the run is complete


def test_a_fold_outside_the_main_thread_leaves_signals_alone():
    import signal
    import threading

    before, out = signal.getsignal(signal.SIGINT), []
    thread = threading.Thread(target=lambda: out.append(fold(lambda s, x: (s, {"x": x}), S(), range(3))))
    thread.start()
    thread.join()
    assert out[0][0].step == 3 and signal.getsignal(signal.SIGINT) is before


# --- memory --------------------------------------------------------------------------------------
_HEAP_PROBE = """
import ctypes, sys
from rlcore.loops.fold import follow_live_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.mallinfo2.restype = Info
set_ = follow_live_memory() if sys.argv[1] == "fixed" else False
libc.free(libc.malloc(8 << 20))  # a mapped block freed: glibc's default raises its threshold to 8 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(1 << 20)
print(set_, libc.mallinfo2().hblkhd - before >= 1 << 20)  # was the 1 MiB block mapped?
libc.free(block)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("mode, expected", [("default", "False False"), ("fixed", "True True")])
def test_follow_live_memory_maps_blocks_after_a_large_one_was_freed(mode, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, env=env,
                          check=True)
    assert done.stdout.split("\n")[-2] == expected


def test_follow_live_memory_leaves_a_threshold_the_environment_chose(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert follow_live_memory() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert follow_live_memory() is False
