"""Random draws replayed exactly, reproducible, whatever draws: seeded or from owned generators.

The strongest check: with the same seed, every checkpoint mode gives the same
outputs and gradients, bit for bit. Recomputation that drew different numbers
than its forward would give gradients of another function, and differ. Two
CPU partitions on threads of their own share the CPU generator and seed each
draw; a single partition owns it and draws with no mode in the way.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo import convert_frame

from pipeline import Pipe, is_checkpointing, is_recomputing
from pipeline.runtime import rng
from pipeline.runtime.ownership import holds_compiled, randomness_plans
from pipeline.runtime.partitions import PartitionRuntime
from tests.helpers import Rendezvous, grads

MODES = ("always", "except_last", "never")


class FunctionalDropout(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, 0.5, self.training)


class RandLike(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * (torch.rand_like(x) > 0.3)


class BernoulliInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.empty_like(x).bernoulli_(0.6) / 0.6


class GaussianNoise(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 0.1 * torch.randn(x.shape, dtype=x.dtype)


class StochasticDepth(nn.Module):
    """Drops whole rows of a residual branch, as torchvision's stochastic depth does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.branch = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.empty(x.size(0), 1, dtype=x.dtype).bernoulli_(0.7) / 0.7
        return x + self.branch(x) * keep


class AttentionDropout(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        q = x.view(x.size(0), 2, 4, x.size(1) // 8)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3 if self.training else 0.0)
        return out.reshape_as(x)


class MultiheadSelfAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width // 4, 2, dropout=0.3, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.view(x.size(0), 4, -1)
        return self.attention(tokens, tokens, tokens)[0].reshape_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(width // 4, 2, width, dropout=0.2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x.view(x.size(0), 4, -1)).reshape_as(x)


class OwnGenerator(nn.Module):
    """Draws from a generator of its own, passed to the op: a keyword in rand's schema,
    positional in poisson's."""

    def __init__(self, op: str = "rand") -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return x * own_draw(self.op, x.shape, self.generator, x.dtype)


def own_draw(op: str, shape: torch.Size, generator: torch.Generator, dtype: torch.dtype) -> Tensor:
    if op == "poisson":
        return torch.poisson(torch.full(shape, 2.0, dtype=dtype), generator=generator)
    return torch.rand(shape, generator=generator, dtype=dtype)


WIDTH = 32
RANDOM_LAYERS: dict[str, Callable[[], nn.Module]] = {
    "nn.Dropout": lambda: nn.Dropout(0.5),
    "F.dropout": FunctionalDropout,
    "rand_like": RandLike,
    "bernoulli_": BernoulliInPlace,
    "randn": GaussianNoise,
    "stochastic depth": lambda: StochasticDepth(WIDTH),
    "SDPA dropout_p": AttentionDropout,
    "nn.MultiheadAttention": lambda: MultiheadSelfAttention(WIDTH),
    "nn.TransformerEncoderLayer": lambda: TransformerBlock(WIDTH),
}


def random_model(make: Callable[[], nn.Module], partitions: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(partitions):
        layers += [nn.Linear(WIDTH, WIDTH), make(), nn.Tanh()]
    return nn.Sequential(*layers).double()


def step(pipe: Pipe, x: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    pipe.zero_grad()
    x = x.clone().requires_grad_()
    out = pipe(x)
    assert isinstance(out, Tensor)
    out.square().sum().backward()
    assert x.grad is not None
    return out.detach(), grads(pipe), x.grad


def assert_modes_agree(
    model: nn.Sequential, partitions: int, chunks: int, seeds: int, threads: str = "auto"
) -> None:
    """Same seed: the same outputs and gradients, bit for bit, in every checkpoint mode."""
    pipes = {
        mode: Pipe(
            copy.deepcopy(model),
            [len(model) // partitions] * partitions,
            devices=["cpu"] * partitions,
            chunks=chunks,
            checkpoint=mode,  # type: ignore[arg-type]
            threads=threads,  # type: ignore[arg-type]
        )
        for mode in MODES
    }
    x = torch.randn(4 * chunks, WIDTH, dtype=torch.double)
    for seed in range(seeds):
        results = {}
        for mode, pipe in pipes.items():
            torch.manual_seed(seed)
            results[mode] = step(pipe, x)
        out, grads_never, x_grad = results["never"]
        for mode in ("always", "except_last"):
            torch.testing.assert_close(results[mode][0], out, rtol=0, atol=0)
            torch.testing.assert_close(results[mode][2], x_grad, rtol=0, atol=0)
            for name, grad in grads_never.items():
                torch.testing.assert_close(results[mode][1][name], grad, rtol=0, atol=0)


@pytest.mark.parametrize("layer", list(RANDOM_LAYERS))
def test_recompute_replays_every_random_op_exactly(layer: str) -> None:
    assert_modes_agree(random_model(RANDOM_LAYERS[layer], 2), partitions=2, chunks=4, seeds=6)


@pytest.mark.parametrize("layer", list(RANDOM_LAYERS))
def test_partitions_owning_their_generator_replay_every_random_op_exactly(layer: str) -> None:
    # One thread runs both partitions: it owns the CPU generator.
    model = random_model(RANDOM_LAYERS[layer], 2)
    assert_modes_agree(model, partitions=2, chunks=4, seeds=4, threads="device")


def dispatch_modes_seen(pipe: Pipe, x: Tensor) -> list[bool]:
    """Whether a dispatch mode was active in each call of the pipe's first layer."""
    seen: list[bool] = []

    def look(*_: object) -> None:
        seen.append(bool(torch.utils._python_dispatch._get_current_dispatch_mode_stack()))

    pipe[0].register_forward_pre_hook(look)
    pipe(x)
    return seen


def test_only_partitions_sharing_a_generator_with_other_threads_seed_each_draw() -> None:
    x = torch.ones(4, 8)
    alone = Pipe(nn.Sequential(nn.Dropout(), nn.Dropout()), [2], devices=["cpu"], chunks=2)
    shared = Pipe(nn.Sequential(nn.Dropout(), nn.Dropout()), [1, 1], devices=["cpu"] * 2, chunks=2)
    one_thread = Pipe(
        nn.Sequential(nn.Dropout(), nn.Dropout()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        threads="device",
    )
    own = Pipe(nn.Sequential(OwnGenerator(), nn.Dropout()), [2], devices=["cpu"], chunks=2)
    assert dispatch_modes_seen(alone, x) == [False, False]
    assert dispatch_modes_seen(shared, x) == [True, True]
    assert dispatch_modes_seen(one_thread, x) == [False, False]
    # Only the mode sees which generator an op is given, so it replays a user generator.
    assert dispatch_modes_seen(own, x) == [True, True]


def test_a_partition_holding_a_generator_of_its_own_is_seeded_and_replayed() -> None:
    assert_modes_agree(random_model(OwnGenerator, 1), partitions=1, chunks=4, seeds=3)


def test_steps_of_partitions_owning_their_generator_replay_exactly() -> None:
    model = random_model(RANDOM_LAYERS["nn.TransformerEncoderLayer"], 2)
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        results = []
        for mode in MODES:
            pipe = Pipe(
                copy.deepcopy(model),
                [3, 3],
                devices=["cpu"] * 2,
                chunks=4,
                checkpoint=mode,  # type: ignore[arg-type]
                threads="device",
            )
            torch.manual_seed(21)
            loss = pipe.step(x, y, F.mse_loss, schedule=schedule)
            results.append((loss, grads(pipe)))
        for loss, found in results[:2]:
            assert torch.equal(loss, results[2][0]), schedule
            assert all(torch.equal(found[k], results[2][1][k]) for k in found), schedule


class DrawsBesideAThread(nn.Module):
    """Dropout, while another thread of the process draws from the CPU generator (forward only)."""

    def forward(self, x: Tensor) -> Tensor:
        if not is_recomputing():
            other = threading.Thread(target=torch.rand, args=(1,))
            other.start()
            other.join()
        return F.dropout(x, 0.5)


def test_recomputation_raises_when_another_thread_drew_from_an_owned_generator() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), DrawsBesideAThread()),
        [2],
        devices=["cpu"],
        checkpoint="always",
    )
    out = pipe(torch.randn(2, 4))
    assert isinstance(out, Tensor)
    with pytest.raises(RuntimeError, match="another thread drew from that generator"):
        out.sum().backward()


# Defined through torch.library.Library, whose ``tags`` older torches (2.11)
# take too; ``torch.library.custom_op(tags=...)`` is newer.
_OPS = torch.library.Library("pipegrad_tests", "FRAGMENT")


def seeded_op(name: str) -> Callable[[Callable[[Tensor, bool], Tensor]], Callable[..., Tensor]]:
    """Registers ``fn(x, flag) -> Tensor`` as an op tagged ``nondeterministic_seeded``."""

    def register(fn: Callable[[Tensor, bool], Tensor]) -> Callable[..., Tensor]:
        _OPS.define(
            f"{name}(Tensor x, bool flag) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,)
        )
        _OPS.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"pipegrad_tests::{name}", lambda x, flag: torch.empty_like(x))
        return getattr(torch.ops.pipegrad_tests, name)  # type: ignore[no-any-return]

    return register


@seeded_op("noise")
def noise(x: Tensor, stray: bool) -> Tensor:
    """Noise like ``x``; ``stray``: a draw not the op's own lands inside its seeded window."""
    if stray:
        torch.rand(1)
    return torch.rand_like(x)


class StrayDrawInForward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x + noise(x.detach(), not is_recomputing()))


def test_recomputation_raises_when_a_seeded_draw_was_disturbed() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), StrayDrawInForward()),
        [1, 1],
        devices=["cpu"] * 2,
        checkpoint="always",
    )
    out = pipe(torch.randn(2, 4))
    assert isinstance(out, Tensor)
    with pytest.raises(RuntimeError, match=r"micro-batch 0 on partition 1 .* draw 1 of"):
        out.sum().backward()


compile_started: list[bool] = []


@seeded_op("noise_beside_a_compile")
def noise_beside_a_compile(x: Tensor, compiling: bool) -> Tensor:
    """Two draws of noise; ``compiling``: another thread tries to compile between them.

    Dynamo compiles under its ``compile_lock`` and, when done, sets the
    default generators back to the states it found (here: before the first
    draw), so a compile that ends inside the draw would repeat its numbers.
    """
    start = torch.default_generator.get_state()
    first = torch.rand_like(x)
    if compiling:

        def compile_beside() -> None:
            started = convert_frame.compile_lock.acquire(blocking=False)
            compile_started.append(started)
            if started:
                torch.default_generator.set_state(start)
                convert_frame.compile_lock.release()

        other = threading.Thread(target=compile_beside)
        other.start()
        other.join()
    return first + torch.rand_like(x)


class NoiseBesideACompile(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * noise_beside_a_compile(x.detach(), not is_recomputing())


def test_a_compile_on_another_thread_cannot_rewind_the_generator_inside_a_seeded_draw() -> None:
    # Found by CI: a layer compiled on one worker thread while the other drew.
    compile_started.clear()
    results = {}
    for mode in ("never", "always"):
        model = nn.Sequential(nn.Linear(4, 4), NoiseBesideACompile())
        pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=mode)  # type: ignore[arg-type]
        torch.manual_seed(3)
        pipe(torch.randn(4, 4)).sum().backward()
        results[mode] = grads(pipe)
    assert compile_started == [False] * 4  # a draw in each task of both passes
    for name, grad in results["never"].items():
        assert torch.equal(results["always"][name], grad), name


def test_a_random_op_writing_into_out_draws_on_the_device_of_out() -> None:
    # Inductor's seeds: aten.randint.low_out(low, high, size, out=buffer).
    buffer = torch.empty(3, dtype=torch.int64, device="meta")
    assert rng._draw_device((0, 10, [3]), {"out": buffer}) == torch.device("meta")


@pytest.mark.parametrize(("partitions", "chunks"), [(3, 6), (4, 8)])
def test_recompute_replays_mixed_random_ops_in_many_partitions(
    partitions: int, chunks: int
) -> None:
    makers = list(RANDOM_LAYERS.values())
    layers: list[nn.Module] = []
    for j in range(partitions):
        layers += [nn.Linear(WIDTH, WIDTH), makers[j % len(makers)](), makers[-1 - j]()]
    assert_modes_agree(nn.Sequential(*layers).double(), partitions, chunks, seeds=4)


def test_gradients_match_the_masks_the_forward_drew() -> None:
    # y = M * x for dropout chains, so dL/dx for L = sum(w * y) must be (y / x) * w.
    makers = [nn.Dropout, FunctionalDropout, lambda: nn.Dropout(0.5), FunctionalDropout]
    for _ in range(10):
        layers = [make() for make in makers]  # type: ignore[operator]
        pipe = Pipe(
            nn.Sequential(*layers), [2, 2], devices=["cpu"] * 2, chunks=6, checkpoint="always"
        )
        x = (torch.rand(24, 64) + 0.5).requires_grad_()
        w = torch.randn(24, 64)
        y = pipe(x)
        assert isinstance(y, Tensor)
        (y * w).sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, (y / x).detach() * w, rtol=0, atol=1e-6)


def test_recomputed_outputs_equal_the_forward_outputs_of_a_transformer_layer() -> None:
    forward: list[Tensor] = []
    recompute: list[Tensor] = []

    def record(module: nn.Module, args: object, output: Tensor) -> None:
        if is_recomputing():
            recompute.append(output.detach())
        elif is_checkpointing():
            forward.append(output.detach())

    layers = [
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True) for _ in range(4)
    ]
    layers[1].register_forward_hook(record)
    pipe = Pipe(nn.Sequential(*layers), [2, 2], devices=["cpu"] * 2, chunks=4)
    for _ in range(5):
        forward.clear()
        recompute.clear()
        pipe(torch.randn(8, 5, 16)).sum().backward()  # type: ignore[union-attr]
        # Backward runs the checkpointed micro-batches in reverse.
        assert len(forward) == len(recompute) == 3
        for a, b in zip(forward, recompute[::-1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["rand", "poisson"])
def test_a_generator_passed_to_an_op_keeps_its_own_stream_and_is_replayed(op: str) -> None:
    # poisson's generator, positional in its schema, was taken for the default
    # one: recomputation drew anew from the layer's (gradients 11.4 off).
    for threads in ("partition", "device"):
        model = random_model(lambda: OwnGenerator(op), 2)
        assert_modes_agree(model, partitions=2, chunks=4, seeds=3, threads=threads)
    layer = OwnGenerator(op)
    plain_generator = torch.Generator().manual_seed(5)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), layer), [1, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4)
    out = pipe(x)
    assert isinstance(out, Tensor)
    out.sum().backward()
    # Forward drew twice (one per micro-batch); recomputation left the stream as it was.
    expected = [own_draw(op, torch.Size([2, 4]), plain_generator, x.dtype) for _ in range(2)]
    assert torch.equal(layer.generator.get_state(), plain_generator.get_state())
    torch.testing.assert_close(out, pipe[0](x) * torch.cat(expected))


@pytest.mark.parametrize("outer_balance", [[1, 1], [2]])
def test_nested_pipe_with_dropout_in_a_checkpointed_partition_is_replayed(
    outer_balance: list[int],
) -> None:
    for _ in range(10):
        inner = Pipe(
            nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], devices=["cpu"] * 2, chunks=2
        )
        outer = Pipe(
            nn.Sequential(nn.Linear(16, 16), inner),
            outer_balance,
            devices=["cpu"] * len(outer_balance),
            chunks=2,
            checkpoint="always",
        )
        with torch.no_grad():
            outer[0].weight.copy_(torch.eye(16))
            outer[0].bias.zero_()
        x = (torch.rand(8, 16) + 0.5).requires_grad_()
        w = torch.randn(8, 16)
        y = outer(x)
        assert isinstance(y, Tensor)
        (y * w).sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, (y / x).detach() * w, rtol=0, atol=1e-6)


def test_fixed_seed_is_reproducible_despite_thread_interleaving() -> None:
    model = random_model(RANDOM_LAYERS["nn.TransformerEncoderLayer"], 3)
    pipe = Pipe(model, [3, 3, 3], devices=["cpu"] * 3, chunks=8, checkpoint="except_last")
    x = torch.randn(32, WIDTH, dtype=torch.double)
    torch.manual_seed(1234)
    first = step(pipe, x)
    for _ in range(8):
        torch.manual_seed(1234)
        again = step(pipe, x)
        assert torch.equal(again[0], first[0]) and torch.equal(again[2], first[2])
        assert all(torch.equal(again[1][k], first[1][k]) for k in first[1])


def test_masks_differ_between_micro_batches_and_between_steps() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Dropout(0.5), nn.Identity()), [1, 1], devices=["cpu"] * 2, chunks=4
    )
    x = torch.ones(8, 64)
    first = pipe(x)
    assert isinstance(first, Tensor)
    masks = first.view(4, 2, 64)
    assert not all(torch.equal(masks[0], masks[k]) for k in range(1, 4))
    second = pipe(x)
    assert isinstance(second, Tensor) and not torch.equal(first, second)


def test_generator_after_a_step_is_deterministic() -> None:
    pipe = Pipe(
        random_model(nn.Dropout, 2), [3, 3], devices=["cpu"] * 2, chunks=4, checkpoint="always"
    )
    x = torch.randn(8, WIDTH, dtype=torch.double)
    draws = []
    for _ in range(3):
        torch.manual_seed(7)
        step(pipe, x)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])


class DrawsNothing(nn.Module):
    """Ops tagged random that draw nothing here: RReLU outside training, draws of no elements."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.rand(0) + torch.randint(0, 3, (0,)) + x.new_empty(0).uniform_()
        return F.rrelu(x, training=False) + empty.sum()


@pytest.mark.parametrize("layer", [nn.Tanh, DrawsNothing])
def test_a_model_without_random_draws_leaves_the_generator_alone(layer: type[nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), layer())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    torch.manual_seed(3)
    pipe(torch.ones(4, 4)).sum().backward()  # type: ignore[union-attr]
    after_pipe = torch.rand(3)
    torch.manual_seed(3)
    model(torch.ones(4, 4)).sum().backward()
    assert torch.equal(torch.rand(3), after_pipe)


def test_partitions_with_dropout_still_run_concurrently() -> None:
    # The generator is locked while one random op runs, not for the whole
    # task: both partitions reach the barrier at once.
    barrier = threading.Barrier(2, timeout=10)
    model = nn.Sequential(
        nn.Dropout(0.5), Rendezvous(barrier, call=2), nn.Dropout(0.5), Rendezvous(barrier, call=1)
    )
    pipe = Pipe(model, [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    out = pipe(torch.ones(2, 8))
    assert isinstance(out, Tensor) and not barrier.broken
    assert set(out.unique().tolist()) <= {1.0, 3.0, 7.0}  # (x * 2 or 0) + 1, twice


def test_random_layers_behave_as_usual_outside_a_pipe() -> None:
    dropout = nn.Dropout(0.5)
    Pipe(nn.Sequential(dropout, nn.Identity()), [1, 1], devices=["cpu"] * 2).close()
    torch.manual_seed(3)
    a = dropout(torch.ones(64))
    torch.manual_seed(3)
    b = nn.Dropout(0.5)(torch.ones(64))
    assert torch.equal(a, b)


def test_a_layer_compiled_on_another_thread_makes_every_partition_seed_its_draws() -> None:
    # Dynamo rewinds the default generators when a compilation ends, on the
    # thread that compiled: an owner's draws on another thread would repeat
    # (seen on a GPU: cuda:0 and the CPU in turn, compiled dropout).
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    devices, threads, holding = [gpu, cpu, gpu, cpu], [[0, 2], [1, 3]], [False] * 4

    def seeded(compiled: list[bool]) -> list[bool]:
        return [plan.seeded for plan in randomness_plans(devices, threads, holding, compiled)]

    assert seeded([False] * 4) == [False, True, False, True]
    assert seeded([False, True, False, False]) == [True] * 4
    # A compilation on the owner's own thread ends before its next draw.
    assert seeded([True, False, False, False]) == [False, True, False, True]


def test_a_layer_compiled_after_the_pipe_was_built_makes_every_partition_seed_its_draws() -> None:
    # The device tier's compiled layers are compiled in place once the Pipe
    # exists: on a GPU, cuda:0 and the CPU in turn, the cuda:0 partitions
    # kept owning their generator and the CPU thread's compilation rewound it.
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    partitions = [nn.Sequential(nn.Dropout()) for _ in range(3)]
    runtime = PartitionRuntime(partitions, [gpu, cpu, gpu], positional=False)
    assert [plan.seeded for plan in runtime.randomness([[0, 2], [1]])] == [False, True, False]
    partitions[1][0].compile()
    assert [plan.seeded for plan in runtime.randomness([[0, 2], [1]])] == [True] * 3


class LinearTimesNoise(nn.Linear):
    """linear(x) * uniform noise, drawn from ``self.generator`` once one is given."""

    generator: torch.Generator | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.generator is None:
            return super().forward(x)
        return super().forward(x) * torch.rand(x.shape, generator=self.generator, dtype=x.dtype)


@pytest.mark.parametrize("call", ["pipe(x)", "step"])
def test_a_generator_given_to_a_layer_after_the_pipe_was_built_is_replayed(call: str) -> None:
    # One thread owns the CPU generator; the layer's own generator, given
    # later, is only replayed under the seeding mode (the recomputation drew
    # new numbers: gradients 0.47 off, silently).
    model = nn.Sequential(*(LinearTimesNoise(WIDTH, WIDTH) for _ in range(4))).double()
    x = torch.randn(16, WIDTH, dtype=torch.double)
    results = {}
    for mode in ("never", "always"):
        pipe = Pipe(
            copy.deepcopy(model),
            [2, 2],
            devices=["cpu"] * 2,
            chunks=4,
            checkpoint=mode,  # type: ignore[arg-type]
            threads="device",
        )
        pipe(x)  # a run before the generator is given
        pipe[3].generator = torch.Generator().manual_seed(5)
        if call == "pipe(x)":
            results[mode] = step(pipe, x)[:2]
        else:
            pipe.zero_grad()
            loss = pipe.step(x, x, F.mse_loss, schedule="1f1b")
            results[mode] = (loss, grads(pipe))
    assert torch.equal(results["always"][0], results["never"][0])
    for name, grad in results["never"][1].items():
        assert torch.equal(results["always"][1][name], grad), name


def test_compiled_layers_are_found_whether_the_module_or_its_call_is_compiled() -> None:
    method = nn.Linear(2, 2)
    method.compile()
    assert holds_compiled(nn.Sequential(nn.ReLU(), method))
    assert holds_compiled(nn.Sequential(torch.compile(nn.Linear(2, 2))))
    assert not holds_compiled(nn.Sequential(nn.Linear(2, 2)))


class CheckpointsItself(nn.Module):
    """A layer that recomputes itself (torch's checkpoint, as transformers' gradient
    checkpointing does), dropout inside."""

    def __init__(self, own: bool, reentrant: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.own = own
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            return F.dropout(torch.tanh(self.linear(x)), 0.5)

        if not self.own:
            return inner(x)
        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layer_recomputing_itself_is_refused_where_draws_are_seeded(reentrant: bool) -> None:
    # Its recomputation, inside autograd's backward, drew from the generator's
    # state, not the seeds its forward's draws had: gradients 4.9 off, silently.
    def model(own: bool) -> nn.Sequential:
        torch.manual_seed(3)
        # The first layer gives the reentrant kind an input that requires grad.
        layers = [CheckpointsItself(own, reentrant) for _ in range(2)]
        return nn.Sequential(nn.Linear(8, 8), *layers).double()

    x, y = torch.randn(6, 8, dtype=torch.double), torch.randn(6, 8, dtype=torch.double)
    seeded = Pipe(model(True), [2, 1], devices=["cpu"] * 2, chunks=3, threads="partition")
    with pytest.raises(RuntimeError, match=r"inside a torch\.utils\.checkpoint of a layer's own"):
        seeded.step(x, y, F.mse_loss)
    assert all(p.grad is None for p in seeded.parameters())
    # One thread owns the generator: torch's own replay of its state holds.
    grads = []
    for own in (True, False):
        pipe = Pipe(model(own), [2, 1], devices=["cpu"] * 2, chunks=3, threads="device")
        torch.manual_seed(5)
        pipe.step(x, y, F.mse_loss)
        grads.append([p.grad for p in pipe.parameters()])
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class AttendsItself(nn.Module):
    """Attention under torch's checkpoint, its dropout off (CPU's scaled dot product
    attention is tagged random whatever its dropout), or off in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            q = self.linear(x).view(x.shape[0], 2, 2, 2)
            attended = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
            return F.dropout(attended.reshape(x.shape), 0.5, training=False)

        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)  # type: ignore[no-any-return]


def test_a_layer_recomputing_itself_without_drawing_is_not_refused_where_draws_are_seeded() -> None:
    # Attention with a dropout of 0 was taken for a draw (its op carries torch's tag for
    # random ops whatever its dropout), and transformers' gradient checkpointing over
    # SDPA was refused though no dropout ran, against what the docs say.
    def model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(8, 8), AttendsItself(), AttendsItself()).double()

    x, y = torch.randn(6, 8, dtype=torch.double), torch.randn(6, 8, dtype=torch.double)
    plain = model()
    F.mse_loss(plain(x), y).backward()
    seeded = Pipe(model(), [2, 1], devices=["cpu"] * 2, chunks=1, threads="partition")
    seeded.step(x, y, F.mse_loss)
    for ours, theirs in zip(seeded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
