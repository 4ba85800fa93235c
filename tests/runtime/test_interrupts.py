"""No lock, thread, answer or late write outlives an interruption; two threads may share a Pipe."""

from __future__ import annotations

import _thread
import gc
import random
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.runtime.worker import Replies
from pipeline.skip import discard_stashed, pop, skippable, stash
from pipeline.skip.tracker import current_tracker
from pipeline.step.mail import LocalTransport
from tests.helpers import assert_close_dicts, grads


def finishes(call: Callable[[], object], timeout: float = 20.0) -> bool:
    """Whether ``call()`` returns within ``timeout`` seconds (run on a daemon thread)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


@pytest.fixture
def ctrl_c_after() -> Iterator[Callable[[float], None]]:
    """Deliver a KeyboardInterrupt to the main thread after some seconds, like Ctrl-C."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def test_ctrl_c_during_backward_leaves_every_pipe_usable(
    ctrl_c_after: Callable[[float], None],
) -> None:
    rng = random.Random(0)
    interrupted = 0
    for _ in range(10):
        pipe = Pipe(
            nn.Sequential(*[nn.Dropout(0.5) for _ in range(12)]),
            [6, 6],
            devices=["cpu"] * 2,
            chunks=2,
            checkpoint="always",
        )
        out = pipe(torch.randn(1024, 1024, requires_grad=True))
        assert isinstance(out, Tensor)
        ctrl_c_after(rng.uniform(0.005, 0.08))
        try:
            out.sum().backward()
        except KeyboardInterrupt:
            interrupted += 1
        ctrl_c_after(0)
        assert finishes(lambda p=pipe: p(torch.randn(8, 1024)))  # type: ignore[misc]
        fresh = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)), [1, 1], devices=["cpu"] * 2)
        assert finishes(lambda f=fresh: f(torch.randn(4, 8)))  # type: ignore[misc]
    assert interrupted > 0  # the scenario really interrupted some backward passes


class Noise(nn.Module):
    """Adds noise; raises ``exception`` instead when it is set."""

    exception: BaseException | None = None

    def forward(self, x: Tensor) -> Tensor:
        if Noise.exception is not None:
            raise Noise.exception
        return x + 0.1 * torch.randn_like(x)


@pytest.mark.parametrize("threads", ["partition", "device"])
# StopIteration: torch's checkpoint runs the forward in a generator, which made it a
# RuntimeError ("generator raised StopIteration").
@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt, GeneratorExit, StopIteration])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_base_exception_in_a_random_layer_leaves_the_pipe_usable(
    kind: type[BaseException], checkpoint: str, threads: str
) -> None:
    exception = kind()
    pipe = Pipe(
        nn.Sequential(nn.Linear(8, 8), Noise()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        threads=threads,  # type: ignore[arg-type]
    )
    Noise.exception = exception
    try:
        with pytest.raises(type(exception)):
            pipe(torch.randn(4, 8))
    finally:
        Noise.exception = None
    assert finishes(lambda: pipe(torch.randn(4, 8)).sum().backward())  # type: ignore[union-attr]


def test_exception_in_recomputation_leaves_the_pipe_usable() -> None:
    fail = [True]

    class FailOnceInRecompute(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            from pipeline import is_recomputing

            if is_recomputing() and fail[0]:
                fail[0] = False
                raise KeyboardInterrupt
            return torch.tanh(x) + torch.rand_like(x)

    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), FailOnceInRecompute()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint="always",
    )
    out = pipe(torch.randn(4, 4))
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()  # type: ignore[union-attr]
    assert finishes(lambda: pipe(torch.randn(4, 4)).sum().backward())  # type: ignore[union-attr]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_two_threads_calling_one_pipe_both_get_correct_results(training: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    reference = [layer.weight.detach().clone() for layer in model]
    pipe = Pipe(model, [2, 2], devices=["cpu"] * 2, chunks=4, checkpoint="except_last")
    errors: list[float] = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(20):
            x = torch.randn(16, 16, generator=generator)
            with torch.set_grad_enabled(training):
                out = pipe(x)
                if training:
                    out.sum().backward()  # type: ignore[union-attr]
            expected = x
            for layer, weight in zip(model, reference, strict=True):
                expected = expected @ weight.T + layer.bias.detach()
            errors.append(float((out.detach() - expected).abs().max()))  # type: ignore[union-attr]

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert len(errors) == 40 and max(errors) < 1e-5


class Slow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.5)
        return x * 1


def test_an_interrupted_call_leaves_no_tensor_behind(ctrl_c_after: Callable[[float], None]) -> None:
    pipe = Pipe(nn.Sequential(nn.Identity(), Slow()), [1, 1], devices=["cpu"] * 2, chunks=2)
    big = torch.randn(4096, 256)
    seen: list[weakref.ref[Tensor]] = []
    pipe[0].register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    ctrl_c_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        pipe(big)
    time.sleep(1.5)  # the worker finishes the task it had started
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    out = pipe(big)
    assert isinstance(out, Tensor) and torch.equal(out, big)


@skippable(stash=["s"])
class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Any:
        s = torch.tanh(x)
        self.refs.append(weakref.ref(s))
        yield stash("s", s)
        return x * 2


@skippable(pop=["s"])
class Up(nn.Module):
    def forward(self, x: Tensor) -> Any:
        s = yield pop("s")
        return x + s


class Fail(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("bad batch")


def test_a_failed_plain_run_keeps_at_most_one_stash_per_skip_until_discarded() -> None:
    down = Down()
    model = nn.Sequential(down, Fail(), Up())
    for _ in range(3):
        with pytest.raises(RuntimeError, match="bad batch"):
            model(torch.randn(4, 8))
    gc.collect()
    assert sum(ref() is not None for ref in down.refs) == 1
    discard_stashed()
    gc.collect()
    assert current_tracker().tensors == {}
    assert all(ref() is None for ref in down.refs)


class Gate:
    """Holds the first pass through a gated layer, once armed, until it is released."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()  # a pass is held
        self.release = threading.Event()
        self.finished = threading.Event()  # the held pass is done
        self.released_in_time = True

    @contextmanager
    def passage(self) -> Iterator[None]:
        if not self.armed:
            yield
            return
        self.armed = False
        self.entered.set()
        self.released_in_time = self.release.wait(30)
        yield
        self.finished.set()


class GatedIdentity(torch.autograd.Function):
    """The identity, whose backward goes through the gate."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, gate: Gate) -> Tensor:
        ctx.gate = gate
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        with ctx.gate.passage():
            return grad, None


class GatedBackward(nn.Module):
    """A linear map whose backward is held at the gate on its input's path or its weight's.

    With zb-h1 the input's path runs in the I action, the weight's in W.
    """

    def __init__(self, gate: Gate, path: str) -> None:
        super().__init__()
        self.gate, self.path = gate, path
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if self.path == "input":
            x = GatedIdentity.apply(x, self.gate)
        else:
            weight = GatedIdentity.apply(weight, self.gate)
        return x @ weight.T


class GatedForward(nn.Module):
    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: Tensor) -> Tensor:
        with self.gate.passage():
            return x * 2


class Sigints:
    """SIGINT raises KeyboardInterrupt, as Python's default handler does, and is counted."""

    def __init__(self) -> None:
        self.handled = threading.Semaphore(0)

    def handle(self, signum: int, frame: Any) -> None:
        self.handled.release()
        signal.default_int_handler(signum, frame)

    def press(self) -> None:
        """Ctrl-C: a real SIGINT to the main thread (which wakes a blocked wait); wait until
        the main thread has handled it."""
        main = threading.main_thread().ident or 0
        deadline = time.monotonic() + 30
        signal.pthread_kill(main, signal.SIGINT)
        # A SIGINT that comes just before the main thread blocks waits for its next
        # wake-up: send it again (pending ones are handled once) until it is handled.
        while not self.handled.acquire(timeout=5):
            assert time.monotonic() < deadline, "the main thread did not handle SIGINT"
            signal.pthread_kill(main, signal.SIGINT)


@pytest.fixture
def sigints() -> Iterator[Sigints]:
    sigints = Sigints()
    previous = signal.signal(signal.SIGINT, sigints.handle)
    yield sigints
    signal.signal(signal.SIGINT, previous)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(0.001)


def main_thread_waits_for_answers() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    return frame is not None and frame.f_code is Replies.collect.__code__


class CtrlC(threading.Thread):
    """Presses Ctrl-C while the gate holds a pass; then opens the gate.

    The first press comes once the main thread waits for its workers'
    answers, a second one, if ``again_after`` is given, once that event is
    set. The gate opens once the main thread has raised (``raised``) or has
    gone back to waiting: a call that raised before its workers were done is
    seen as such.
    """

    def __init__(
        self, gate: Gate, sigints: Sigints, again_after: threading.Event | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.gate, self.sigints, self.again_after = gate, sigints, again_after
        self.raised = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            assert self.gate.entered.wait(30), "no pass reached the gate"
            wait_until(main_thread_waits_for_answers, "the main thread waits for answers")
            self._press()
            if self.again_after is not None:
                assert self.again_after.wait(30), "the first interrupt was not acted on"
                self._press()
        except BaseException as exception:
            self.errors.append(exception)
        finally:
            self.gate.release.set()

    def _press(self) -> None:
        self.sigints.press()
        wait_until(
            lambda: self.raised.is_set() or main_thread_waits_for_answers(),
            "the main thread raised or went back to waiting",
        )


class InterruptMain(CtrlC):
    """Interrupts as ``_thread.interrupt_main`` does (a debugger, a watchdog): no signal, so
    no blocked wait wakes for it; the main thread sees it when it next runs Python."""

    def _press(self) -> None:
        _thread.interrupt_main()
        assert self.sigints.handled.acquire(timeout=30), "the main thread never saw it"
        wait_until(
            lambda: self.raised.is_set() or main_thread_waits_for_answers(),
            "the main thread raised or went back to waiting",
        )


def interrupted(
    call: Callable[[], object],
    gate: Gate,
    ctrl_c: CtrlC,
    when_raised: Callable[[], object] = lambda: None,
) -> KeyboardInterrupt:
    """Run ``call``, which ``ctrl_c`` interrupts at the gate; check that it raised only once
    the held pass was done. ``when_raised`` runs right after the raise."""
    gate.armed = True
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            call()
        done_when_raised = gate.finished.is_set()
        ctrl_c.raised.set()
        when_raised()
        ctrl_c.join(60)
    except KeyboardInterrupt:
        pytest.fail("an interrupt reached the test after the call had raised")
    assert not ctrl_c.is_alive() and ctrl_c.errors == [] and gate.released_in_time
    assert done_when_raised, "the call raised while a worker still ran the held pass"
    return raised.value


def gated_model(gate: Gate, path: str) -> nn.Sequential:
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    return nn.Sequential(first, GatedBackward(gate, path), nn.Tanh(), last)


STEP_X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
STEP_Y = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def interrupted_step(
    sigints: Sigints,
    schedule: str,
    path: str,
    again_after: threading.Event | None = None,
    threads: str = "auto",
    press: type[CtrlC] = CtrlC,
) -> None:
    """A step interrupted while partition 1 is held in backward leaves nothing in ``.grad``
    after ``zero_grad``, and the next step's gradients are a clean step's."""
    gate = Gate()
    pipe = Pipe(
        gated_model(gate, path),
        [1, 3],
        devices=["cpu"] * 2,
        chunks=2,
        threads=threads,  # type: ignore[arg-type]
    )
    raised = interrupted(
        lambda: pipe.step(STEP_X, STEP_Y, nn.functional.mse_loss, schedule=schedule),
        gate,
        press(gate, sigints, again_after),
        when_raised=lambda: pipe.zero_grad(set_to_none=True),
    )
    assert [p.grad for p in pipe.parameters()] == [None] * 5
    if again_after is not None:
        notes = getattr(raised, "__notes__", [])
        assert any("a further KeyboardInterrupt()" in note for note in notes)
    pipe.step(STEP_X, STEP_Y, nn.functional.mse_loss, schedule=schedule)
    plain = gated_model(Gate(), path)
    nn.functional.mse_loss(plain(STEP_X), STEP_Y).backward()
    assert_close_dicts(grads(pipe), grads(plain))


@pytest.mark.parametrize(
    ("schedule", "path"),
    [("1f1b", "weight"), ("zb-h1", "input"), ("zb-h1", "weight")],
    ids=["1f1b-B", "zb-h1-I", "zb-h1-W"],
)
def test_ctrl_c_in_step_raises_after_the_action_under_way_and_leaves_grad_alone(
    sigints: Sigints, schedule: str, path: str
) -> None:
    interrupted_step(sigints, schedule, path)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_ctrl_c_in_a_step_of_stages_sharing_a_thread_raises_after_the_action_under_way(
    sigints: Sigints, schedule: str
) -> None:
    interrupted_step(sigints, schedule, "weight", threads="device")


def test_an_interrupt_that_is_no_signal_raises_after_the_action_under_way(
    sigints: Sigints,
) -> None:
    # The caller slept on its workers' answers without a timeout: the step ran all its
    # actions, then raised.
    interrupted_step(sigints, "1f1b", "weight", press=InterruptMain)


def test_a_second_ctrl_c_does_not_make_step_return_early(
    sigints: Sigints, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted = threading.Event()
    abort = LocalTransport.abort

    def observed_abort(self: LocalTransport, error: BaseException | None = None) -> None:
        abort(self, error)
        aborted.set()

    # Pressed again once the step has acted on the first interrupt (aborted the
    # transport): the second comes while the step waits for the held pass.
    monkeypatch.setattr(LocalTransport, "abort", observed_abort)
    interrupted_step(sigints, "1f1b", "weight", again_after=aborted)


@pytest.mark.parametrize("threads", ["partition", "device"])
def test_ctrl_c_in_a_forward_raises_after_the_tasks_under_way(
    sigints: Sigints, threads: str
) -> None:
    # "device": the cycle's tasks run one after the other on one thread.
    gate = Gate()
    norm = nn.BatchNorm1d(4).double()
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4).double(), GatedForward(gate), norm),
        [1, 2],
        devices=["cpu"] * 2,
        chunks=2,
        threads=threads,  # type: ignore[arg-type]
    )
    at_raise: list[Tensor] = []
    interrupted(
        lambda: pipe(STEP_X),
        gate,
        CtrlC(gate, sigints),
        when_raised=lambda: at_raise.extend(b.clone() for b in norm.buffers()),
    )
    # The held micro-batch went through the BatchNorm before the call raised, the
    # other one never reached it.
    assert int(at_raise[2]) == 1
    pipe.eval()
    pipe(STEP_X)  # runs after anything left on the workers; eval updates no statistics
    for now, then in zip(norm.buffers(), at_raise, strict=True):
        assert torch.equal(now, then)


def test_interrupt_while_waiting_leaves_no_stale_result_for_the_next_call(
    sigints: Sigints,
) -> None:
    class InterruptOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fired = False

        def forward(self, x: Tensor) -> Tensor:
            if not self.fired:
                self.fired = True
                sigints.press()  # the caller is interrupted while this task still runs
            return x * 2

    pipe = Pipe(
        nn.Sequential(nn.Identity(), InterruptOnce()), [1, 1], devices=["cpu"] * 2, chunks=2
    )
    with pytest.raises(KeyboardInterrupt):
        pipe(torch.ones(2, 1))
    out = pipe(torch.full((2, 1), 3.0))
    assert torch.equal(out, torch.full((2, 1), 6.0))  # type: ignore[arg-type]


def test_ctrl_c_while_waiting_for_a_generator_leaves_no_lock_held(sigints: Sigints) -> None:
    """The main thread, blocked on a generator's lock that a worker holds, gets Ctrl-C:
    neither that lock nor dynamo's compile lock, taken before it, stays held (a held one
    left every later draw of every Pipe waiting forever)."""
    from torch._dynamo import convert_frame

    from pipeline.runtime import rng

    generator = torch.Generator()
    lock = rng._lock(generator)
    lock.acquire()

    def waits_for_the_generator() -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        return frame is not None and frame.f_code is rng._state.__code__

    def press_then_release() -> None:
        try:
            wait_until(waits_for_the_generator, "the main thread waits for the generator")
            sigints.press()
        finally:
            lock.release()

    presser = threading.Thread(target=press_then_release, daemon=True)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        rng._state(generator)
    presser.join(60)
    assert not presser.is_alive()

    free: list[bool] = []

    def try_both() -> None:
        for other in (convert_frame.compile_lock, lock):
            free.append(other.acquire(timeout=5))
            if free[-1]:
                other.release()

    checker = threading.Thread(target=try_both, daemon=True)
    checker.start()
    checker.join(60)
    assert free == [True, True]
