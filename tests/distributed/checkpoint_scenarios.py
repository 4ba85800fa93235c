"""Checkpoint scenarios: saved in one layout, loaded in another, trained on, by every rank.

They run in the process groups of tests/distributed/test_distributed_pipe.py
(stage_scenarios.py imports them), so as to start none of their own.
Each scenario trains a model 2 AdamW steps in one layout, saves, loads into
other layouts (another balance, a Pipe or the plain model in one process, a
pp x dp grid) and trains 2 more steps: the weights must be those of the plain
model trained 4 steps without the round trip (float64). The helpers serve
tests/distributed/test_checkpoints.py's one-process tests too.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from pipeline import DataParallel, Pipe
from pipeline.distributed import DistributedPipe, load_checkpoint, save_checkpoint
from tests.gloo_groups import expect_error, rank, scenario, world

WIDTH = 8
STEPS = 4
SAVED_AFTER = 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(11, WIDTH)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.token(tokens)


class Head(nn.Module):
    """The output layer, tied to the embedding."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.embedding.weight.t()


@dataclass(frozen=True)
class Model:
    """A model to checkpoint, its balances (two stages, another two, a Pipe's), its data."""

    name: str
    build: Callable[[int], nn.Sequential]
    balances: tuple[list[int], list[int], list[int]]
    tokens: bool

    def batch(self, step: int, rows: int = 8) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        if self.tokens:
            x, y = torch.randint(0, 11, (2, rows), generator=gen)
        else:
            x, y = torch.randn(2, rows, WIDTH, generator=gen, dtype=torch.double)
        return x, y

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target) if self.tokens else F.mse_loss(output, target)


def _blocks(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _tied(seed: int) -> nn.Sequential:
    """Embedding, 2 x (Linear, Tanh), a head tied to the embedding: the tie crosses stages."""
    torch.manual_seed(seed)
    embed = Embed()
    layers = [embed, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, Head(embed.token)).double()


def _mlps(seed: int) -> nn.Sequential:
    """4 MLP blocks (Linear, Tanh, Linear): units for FSDP2, Megatron's split for TP."""
    torch.manual_seed(seed)
    layers = [
        nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        for _ in range(4)
    ]
    return nn.Sequential(*layers).double()


BLOCKS = Model("blocks", _blocks, ([4, 4], [2, 6], [3, 5]), tokens=False)
MLPS = Model("mlps", _mlps, ([2, 2], [1, 3], [1, 3]), tokens=False)
TIED = Model("tied", _tied, ([3, 3], [2, 4], [2, 4]), tokens=True)
MODELS = (BLOCKS, TIED)


def adamw(module: nn.Module) -> torch.optim.AdamW:
    """AdamW with two param groups: weights with decay, the rest without."""
    named = list(module.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
        ],
        lr=0.05,
    )


def train(
    model: Model,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    replica: int = 0,
    replicas: int = 1,
) -> None:
    """One step on the step's batch (this replica's share of it)."""
    x, y = model.batch(step)
    share = slice(replica * len(x) // replicas, (replica + 1) * len(x) // replicas)
    optimizer.zero_grad()
    if isinstance(module, (Pipe, DistributedPipe, DataParallel)):
        module.step(x[share], y[share], model.loss)
    else:
        model.loss(module(x), y).backward()
    optimizer.step()


@dataclass
class Uninterrupted:
    """The plain model trained STEPS steps: the weights after each, by every name of each.

    ``state`` and ``settings``: its optimizer's state and param group
    settings when the layouts save (after SAVED_AFTER steps), by name too.
    """

    weights: list[dict[str, Tensor]]
    state: dict[str, dict[str, Any]]
    settings: dict[str, dict[str, Any]]


def uninterrupted(model: Model) -> Uninterrupted:
    plain = model.build(0)
    optimizer = adamw(plain)
    weights = []
    saved: dict[str, Any] = {}
    for step in range(STEPS):
        if step == SAVED_AFTER:
            saved = copy.deepcopy(optimizer.state_dict())  # parameters by position
        train(model, plain, optimizer, step)
        weights.append({n: p.detach().clone() for n, p in _named(plain)})
    order = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(p): i for i, p in enumerate(order)}
    state, settings = {}, {}
    for name, param in _named(plain):
        i = position[id(param)]
        state[name] = saved["state"].get(i, {})
        group = next(g for g in saved["param_groups"] if i in g["params"])
        settings[name] = {k: v for k, v in group.items() if k != "params"}
    return Uninterrupted(weights, state, settings)


def _named(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters(remove_duplicate=False))


def assert_resumes(
    model: Model,
    reference: Uninterrupted,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    what: str,
    replica: int = 0,
    replicas: int = 1,
) -> None:
    """The loaded optimizer holds the saved AdamW state; the next steps give the same weights."""
    inner = module.module if isinstance(module, DataParallel) else module
    assert_adamw_state(reference, inner, optimizer, what)
    for step in range(SAVED_AFTER, STEPS):
        train(model, module, optimizer, step, replica, replicas)
        for name, param in _named(inner):
            torch.testing.assert_close(
                full(param.detach()),
                reference.weights[step][name],
                rtol=0,
                atol=1e-12,
                msg=lambda m, name=name, step=step: f"{what}, step {step}, {name}: {m}",
            )


def full(tensor: Tensor) -> Tensor:
    """A sharded tensor (a DTensor of FSDP2 or tensor parallelism) whole; others as they are."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_adamw_state(
    reference: Uninterrupted, module: nn.Module, optimizer: torch.optim.Optimizer, what: str
) -> None:
    """Every parameter's step, exp_avg, exp_avg_sq and group settings are the saved ones."""
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    for name, param in _named(module):
        saved, state = reference.state[name], optimizer.state[param]
        assert state.keys() == saved.keys() == {"step", "exp_avg", "exp_avg_sq"}, f"{what}, {name}"
        for field in saved:
            torch.testing.assert_close(
                full(state[field]), saved[field], rtol=0, atol=1e-12, msg=f"{what}, {name}.{field}"
            )
        for setting in ("lr", "betas", "eps", "weight_decay"):
            mine, theirs = group_of[param][setting], reference.settings[name][setting]
            assert mine == theirs, f"{what}, {name}: {setting} {mine}, saved {theirs}"


def refused_untouched(
    load: Callable[[], None], module: nn.Module, optimizer: torch.optim.Optimizer, *fragments: str
) -> str:
    """``load`` raises a RuntimeError saying ``fragments``; the weights and the optimizer's own
    state (the very objects, their values) and settings are as they were."""
    weights = {n: full(p.detach()).clone() for n, p in module.named_parameters()}
    state = optimizer.state
    fields = {p: {k: full(v).clone() for k, v in s.items()} for p, s in state.items()}
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    message = expect_error(RuntimeError, load, *fragments)
    for name, param in module.named_parameters():
        torch.testing.assert_close(full(param.detach()), weights[name], rtol=0, atol=0, msg=name)
    assert optimizer.state is state, "the optimizer's state was replaced"
    assert state.keys() == fields.keys()
    for param, before in fields.items():
        assert state[param].keys() == before.keys()
        for field, value in before.items():
            actual = full(state[param][field])
            torch.testing.assert_close(actual, value, rtol=0, atol=0, msg=field)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == (
        settings
    )
    return message


@contextlib.contextmanager
def shared_directory(name: str) -> Iterator[Path]:
    """A directory every rank of this group sees, removed once all are done with it."""
    directory = Path(tempfile.gettempdir()) / f"checkpoints-{os.environ['MASTER_PORT']}" / name
    try:
        yield directory
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
            with contextlib.suppress(OSError):  # the group's folder, once its last one is gone
                directory.parent.rmdir()


def each_process_alone() -> dist.ProcessGroup:
    """A group of this process only (made collectively): DCP in one process of the job."""
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world())])
    assert alone is not None
    return alone


def two_stages(model: Model, balance: list[int], seed: int) -> DistributedPipe:
    return DistributedPipe(model.build(seed), balance, chunks=2)


# World 2: two stage processes.


@scenario
def two_stages_save_and_another_balance_a_pipe_and_the_plain_model_resume() -> None:
    alone = each_process_alone()
    for model in MODELS:
        reference = uninterrupted(model)
        first, other, pipe_balance = model.balances
        with shared_directory(f"pp2-{model.name}") as path:
            saving = two_stages(model, first, seed=0)
            optimizer = adamw(saving)
            for step in range(SAVED_AFTER):
                train(model, saving, optimizer, step)
            save_checkpoint(path, saving, optimizer)
            saving.close()

            loading = two_stages(model, other, seed=7)
            optimizer = adamw(loading)
            load_checkpoint(path, loading, optimizer)
            assert_resumes(model, reference, loading, optimizer, f"{model.name}: pp=2 {other}")
            loading.close()

            # Each process alone: one process of another job.
            pipe = Pipe(model.build(7), pipe_balance, devices=["cpu"] * 2, chunks=2)
            plain = model.build(7)
            for module, what in ((pipe, f"Pipe {pipe_balance}"), (plain, "the plain model")):
                optimizer = adamw(module)
                load_checkpoint(path, module, optimizer, process_group=alone)
                assert_resumes(model, reference, module, optimizer, f"{model.name}: {what}")
            pipe.close()


@scenario
def the_plain_model_or_a_pipe_saves_and_two_stages_resume() -> None:
    alone = each_process_alone()
    for model, saver in ((BLOCKS, "the plain model"), (TIED, "a Pipe")):
        reference = uninterrupted(model)
        first, _, pipe_balance = model.balances
        with shared_directory(f"one-process-{model.name}") as path:
            if rank() == 0:  # one process of another job
                module = model.build(0)
                if saver == "a Pipe":
                    module = Pipe(module, pipe_balance, devices=["cpu"] * 2, chunks=2)
                optimizer = adamw(module)
                for step in range(SAVED_AFTER):
                    train(model, module, optimizer, step)
                save_checkpoint(path, module, optimizer, process_group=alone)
                if isinstance(module, Pipe):
                    module.close()
            dist.barrier()
            loading = two_stages(model, first, seed=7)
            optimizer = adamw(loading)
            load_checkpoint(path, loading, optimizer)
            assert_resumes(model, reference, loading, optimizer, f"{model.name} from {saver}")
            loading.close()


def untied(model: Model, seed: int) -> nn.Sequential:
    """TIED's model with a head of its own: two values under the tied weight's two names."""
    module = model.build(seed)
    module[5].embedding = nn.Embedding(11, WIDTH).double()
    assert not torch.equal(module[0].token.weight, module[5].embedding.weight)
    return module


UNTIED = "different values under model.0.token.weight and model.5.embedding.weight"


@scenario
def a_checkpoint_whose_names_of_a_tied_weight_differ_is_refused_by_every_process() -> None:
    # An untied model's checkpoint: torch's load_state_dict keeps the last name's value,
    # this load read the first's (both stage processes alike), silently.
    saving = untied(TIED, seed=0)
    optimizer = adamw(saving)
    train(TIED, saving, optimizer, 0)
    alone = each_process_alone()
    with shared_directory("untied") as path:
        if rank() == 0:
            save_checkpoint(path, saving, optimizer, process_group=alone)
        dist.barrier()
        pipe = two_stages(TIED, TIED.balances[0], seed=7)
        loaded = adamw(pipe)
        train(TIED, pipe, loaded, 0)
        load = lambda: load_checkpoint(path, pipe, loaded)  # noqa: E731
        refused_untouched(load, pipe, loaded, "refused, nothing was loaded", UNTIED, "not tied")
        pipe.close()


@scenario
def torch_calls_with_a_flattened_optimizer_state_resume_two_stages() -> None:
    # The recipe of docs/distributed_pipe.md for torch's own calls: no tie, no DataParallel.
    model = BLOCKS
    reference = uninterrupted(model)
    first, other, _ = model.balances
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    with shared_directory("torch-calls") as path:
        saving = two_stages(model, first, seed=0)
        optimizer = adamw(saving)
        for step in range(SAVED_AFTER):
            train(model, saving, optimizer, step)
        model_state, optimizer_state = get_state_dict(saving, optimizer, options=flat)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=path)
        saving.close()
        loading = two_stages(model, other, seed=7)
        optimizer = adamw(loading)
        model_state, optimizer_state = get_state_dict(loading, optimizer, options=flat)
        state: dict[str, Any] = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            loading,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=flat,
        )
        assert_resumes(model, reference, loading, optimizer, "torch's calls")
        loading.close()


def trained_and_saved(model: Model, path: Path) -> tuple[DistributedPipe, torch.optim.Optimizer]:
    """Two stages of ``model`` (balance [4, 4]) after one AdamW step, saved into ``path``."""
    pipe = two_stages(model, [4, 4], seed=0)
    optimizer = adamw(pipe)
    train(model, pipe, optimizer, 0)
    save_checkpoint(path, pipe, optimizer)
    return pipe, optimizer


@scenario
def a_load_is_refused_on_every_process_for_keys_no_process_asks_for_or_a_shape_one_finds() -> None:
    model = BLOCKS
    with shared_directory("strict") as path:
        saving, _ = trained_and_saved(model, path)
        saving.close()

        # Layers 0-5 in two stages: rank 0 asks for model.0 and model.2, rank 1 for
        # model.4; together, for every key but model.6's, which no process asks for.
        shallower = DistributedPipe(nn.Sequential(*model.build(7)[:6]), [3, 3], chunks=2)
        loaded = adamw(shallower)
        train(model, shallower, loaded, 0)
        refused_untouched(
            lambda: load_checkpoint(path, shallower, loaded),
            shallower,
            loaded,
            "holds model.6.bias, model.6.weight and ",
            "keys of the optimizer's state",
            "no process of the load asks for",
        )
        shallower.close()

        # Wider layers in rank 1's stage alone: rank 0 refuses too, naming them.
        wider = model.build(7)
        wider[4], wider[6] = nn.Linear(WIDTH, 16).double(), nn.Linear(16, WIDTH).double()
        pipe = DistributedPipe(wider, [4, 4], chunks=2)
        loaded = adamw(pipe)
        train(model, pipe, loaded, 0)
        refused_untouched(
            lambda: load_checkpoint(path, pipe, loaded),
            pipe,
            loaded,
            "shapes differ on rank 1: model.4.bias is (8,) in the checkpoint, (16,) in the model",
        )
        # A scheduler over each process's own param groups: DCP would keep one's base_lrs.
        per_group = torch.optim.SGD(pipe.parameters(), lr=0.1 * (rank() + 1))
        scheduler = torch.optim.lr_scheduler.StepLR(per_group, step_size=1)
        expect_error(
            ValueError,
            lambda: save_checkpoint(path, pipe, extra={"scheduler": scheduler}),
            "extra['scheduler'] differs between the processes",
        )
        save_checkpoint(path, pipe, extra={f"scheduler.{rank()}": scheduler})

        # A failure on rank 0 alone fails every process at once, none left waiting in
        # DCP's collectives, none going on as if it had worked.
        class Unsaved:
            def state_dict(self) -> dict[str, int]:
                if rank() == 0:
                    raise KeyError("no state here")
                return {"steps": 1}

        class Unloaded:
            def state_dict(self) -> dict[str, int]:
                return {"steps": 0}

            def load_state_dict(self, state: dict[str, int]) -> None:
                if rank() == 0:
                    raise KeyError("cannot take it")

        save = lambda: save_checkpoint(path, pipe, extra={"f": Unsaved()})  # noqa: E731
        load = lambda: load_checkpoint(path, pipe, extra={"f": Unloaded()})  # noqa: E731
        if rank() == 0:
            expect_error(KeyError, save, "no state here")
        else:
            expect_error(ValueError, save, "rank 0 failed reading extra: KeyError")
        missing = path / "elsewhere" if rank() == 0 else path
        expect_error(
            RuntimeError, lambda: load_checkpoint(missing, pipe), "rank 0 failed reading it"
        )
        save_checkpoint(path, pipe, extra={"f": Unloaded()})
        if rank() == 0:
            expect_error(KeyError, load, "cannot take it")
        else:
            expect_error(RuntimeError, load, "after the weights here were read", "KeyError")
        pipe.close()


@contextlib.contextmanager
def a_full_disk(here: bool = True, after_writing: bool = False) -> Iterator[None]:
    """DCP's writes failing in this process (if ``here``) as on a full disk: at once, or
    ``after_writing`` its files."""
    write = FileSystemWriter.write_data

    def full(writer: FileSystemWriter, plan: Any, planner: Any) -> Any:
        if after_writing:
            write(writer, plan, planner).wait()
        raise OSError(errno.ENOSPC, "No space left on device")

    if not here:
        yield
        return
    with mock.patch.object(FileSystemWriter, "write_data", full):
        yield


def weights(module: nn.Module) -> dict[str, Tensor]:
    return {name: full(p.detach()).clone() for name, p in module.named_parameters()}


def assert_weights(module: nn.Module, expected: dict[str, Tensor], what: str) -> None:
    for name, param in module.named_parameters():
        torch.testing.assert_close(
            full(param.detach()), expected[name], rtol=0, atol=0, msg=f"{what}: {name}"
        )


@scenario
def a_save_failing_on_one_process_leaves_the_checkpoint_there_as_it_was() -> None:
    # Saved again into its directory, rank 1's disk full: rank 0's new files went over the
    # old ones, under the old metadata, and the mix of two steps loaded without an error.
    model = BLOCKS
    with shared_directory("latest") as path:
        pipe, optimizer = trained_and_saved(model, path)
        saved = weights(pipe)
        train(model, pipe, optimizer, 1)
        with a_full_disk(here=rank() == 1):
            expect_error(
                ValueError,
                lambda: save_checkpoint(path, pipe, optimizer),
                "failed, the checkpoint there left as it was: rank 1 failed: OSError: [Errno 28]",
            )
        loading = two_stages(model, [4, 4], seed=7)
        loaded = adamw(loading)
        load_checkpoint(path, loading, loaded)
        assert_weights(loading, saved, "after the failed save")
        assert {float(state["step"]) for state in loaded.state.values()} == {1.0}
        save_checkpoint(path, pipe, optimizer)  # a save that succeeds replaces it
        load_checkpoint(path, loading, loaded)
        assert_weights(loading, weights(pipe), "after the second save")
        dist.barrier()
        assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        pipe.close()
        loading.close()


@scenario
def a_damaged_or_missing_data_file_is_refused_by_every_process_naming_it() -> None:
    # DCP failed halfway, on every process, with a CheckpointException: a BaseException
    # that `except Exception` lets through, whose text was remote tracebacks.
    model = BLOCKS
    with shared_directory("damaged") as path:
        pipe, optimizer = trained_and_saved(model, path)
        dist.barrier()
        if rank() == 0:
            (path / "__1_0.distcp").rename(path / "elsewhere")  # which rank 1 alone reads
        dist.barrier()
        refused_untouched(
            lambda: load_checkpoint(path, pipe, optimizer),
            pipe,
            optimizer,
            "refused, nothing was loaded: the checkpoint's data files that rank 1 reads are "
            "damaged or partly copied: __1_0.distcp cannot be read (FileNotFoundError",
        )
        pipe.close()


@scenario
def load_state_dict_with_strict_false_returns_the_keys_of_no_process_as_unexpected() -> None:
    # It returned none: the keys another process holds were dropped with them.
    plain = BLOCKS.build(0)
    state = {**plain.state_dict(), "head.weight": torch.zeros(2, WIDTH)}
    del state["6.bias"]  # rank 1's
    pipe = two_stages(BLOCKS, [4, 4], seed=7)
    result = pipe.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["head.weight"], result
    assert result.missing_keys == (["6.bias"] if rank() == 1 else []), result
    assert BLOCKS.build(7).load_state_dict(state, strict=False).unexpected_keys == ["head.weight"]
    pipe.close()


def tanh_last(seed: int) -> nn.Sequential:
    """Two Linear layers and a Tanh: in [2, 1], rank 1 holds no parameter."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh()).double()


@scenario
def a_process_without_parameters_passes_no_optimizer_and_disagreements_are_refused() -> None:
    # Rank 1 holds a Tanh alone (torch.optim.AdamW([]) raises): the others' extra reads
    # met no peer, and gloo aborted the process at its next collective.
    model = Model("tanh-last", tanh_last, ([2, 1], [2, 1], [2, 1]), tokens=False)
    with shared_directory("no-optimizer") as path:
        saving = two_stages(model, [2, 1], seed=0)
        optimizer = adamw(saving) if rank() == 0 else None
        for step in range(2):
            if optimizer is None:
                saving.step(*model.batch(step), model.loss)
            else:
                train(model, saving, optimizer, step)
        save_checkpoint(path, saving, optimizer)
        loading = two_stages(model, [2, 1], seed=7)
        loaded = adamw(loading) if rank() == 0 else None
        load_checkpoint(path, loading, loaded)
        assert_weights(loading, weights(saving), "loaded")
        if loaded is not None:
            assert {float(state["step"]) for state in loaded.state.values()} == {2.0}
            train(model, loading, loaded, 2)
        else:
            loading.step(*model.batch(2), model.loss)
        saving.close()
        loading.close()

        # A process holding parameters without an optimizer, the other with one: its
        # optimizer's state would be left out. strict differing: only one would refuse.
        pipe = two_stages(BLOCKS, [4, 4], seed=7)
        one = adamw(pipe) if rank() == 0 else None
        lacking = "rank 0 passed an optimizer and rank 1, whose stages hold parameters, none"
        before = weights(pipe)
        expect_error(ValueError, lambda: save_checkpoint(path, pipe, one), lacking)
        expect_error(RuntimeError, lambda: load_checkpoint(path, pipe, one), lacking)
        strict = lambda: load_checkpoint(path, pipe, strict=rank() == 0)  # noqa: E731
        expect_error(RuntimeError, strict, "strict differs between the processes")
        assert_weights(pipe, before, "refused")
        # Frozen parameters alone: refused too, as a trained and then frozen parameter keeps
        # its state, which the checkpoint would lose; an optimizer over them keeps it.
        if rank() == 1:
            pipe.requires_grad_(False)
        expect_error(
            ValueError, lambda: save_checkpoint(path, pipe, one), "over frozen parameters too"
        )
        frozen = one if rank() == 0 else adamw(pipe)
        save_checkpoint(path, pipe, frozen)
        load_checkpoint(path, pipe, frozen)
        assert_weights(pipe, before, "frozen on rank 1")
        pipe.close()


# World 4: pipelines {0, 1} and {2, 3}; stage s of each averaged with its twin.


def grid(model: Model, balance: list[int], seed: int) -> tuple[DataParallel, int]:
    pipelines = [[0, 1], [2, 3]]
    pp_group, _ = dist.new_subgroups_by_enumeration(pipelines)
    dp_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    assert pp_group is not None and dp_group is not None
    pipe = DistributedPipe(model.build(seed), balance, group=pp_group, chunks=2)
    return DataParallel(pipe, process_group=dp_group), rank() // 2


@scenario
def a_grid_saves_and_another_grid_four_stages_a_pipe_and_the_plain_model_resume() -> None:
    model = TIED
    reference = uninterrupted(model)
    first, other, pipe_balance = model.balances
    alone = each_process_alone()
    with shared_directory("grid") as path, shared_directory("four") as resaved:
        saving, replica = grid(model, first, seed=0)
        optimizer = adamw(saving)
        for step in range(SAVED_AFTER):
            train(model, saving, optimizer, step, replica, replicas=2)
        save_checkpoint(path, saving, optimizer)
        saving.module.close()

        loading, replica = grid(model, other, seed=7)
        optimizer = adamw(loading)
        load_checkpoint(path, loading, optimizer)
        assert_resumes(model, reference, loading, optimizer, f"grid {other}", replica, 2)
        loading.module.close()

        # Another number of stage processes: one pipeline of 4, the tie from rank 0 to
        # rank 3. Rank 1 holds a Tanh alone (no state); rank 3 the head alone (an empty
        # param group, the biases'). It saves again what it loaded, for the loads below.
        four = DistributedPipe(model.build(7), [2, 1, 2, 1], chunks=2)
        optimizer = adamw(four)
        load_checkpoint(path, four, optimizer)
        save_checkpoint(resaved, four, optimizer)
        assert_resumes(model, reference, four, optimizer, "pp=4 [2, 1, 2, 1]")
        four.close()

        if rank() in (0, 1):  # one process of another job each
            module: nn.Module = model.build(7)
            if rank() == 0:
                module = Pipe(module, pipe_balance, devices=["cpu"] * 2, chunks=2)
            optimizer = adamw(module)
            load_checkpoint(resaved, module, optimizer, process_group=alone)
            assert_resumes(model, reference, module, optimizer, f"rank {rank()} alone")
            if isinstance(module, Pipe):
                module.close()
