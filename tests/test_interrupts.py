"""No lock, thread or answer outlives an interruption; two threads may share a Pipe."""

from __future__ import annotations

import gc
import random
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import discard_stashed, pop, skippable, stash
from pipeline.skip.tracker import current_tracker


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


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt, GeneratorExit])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_base_exception_in_a_random_layer_leaves_the_pipe_usable(
    kind: type[BaseException], checkpoint: str
) -> None:
    exception = kind()
    pipe = Pipe(
        nn.Sequential(nn.Linear(8, 8), Noise()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint=checkpoint,  # type: ignore[arg-type]
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
