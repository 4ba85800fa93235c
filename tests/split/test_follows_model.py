"""A split model follows its model after the split, or refuses the call (H1-H3 of round 4).

Attributes that the captured code read, hooks on captured modules, replaced
modules: each either gives the plain model's results (float64) or raises
before any work, in a split model and in a Pipe built on one. Buffers that
the captured code rebinds are refused at split time.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from split_models import assert_same, gpt2, gradients, lm_loss, tokens, twin
from torch import Tensor, nn

import pipeline
from pipeline import Pipe


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.linear(x))


class Model(nn.Module):
    """Embed, three blocks, a head divided by a temperature: code around blocks reads attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.temperature = 1.0
        self.scale = torch.tensor(2.0, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale / self.temperature


def split_model() -> tuple[Model, nn.Module, Tensor]:
    model = Model().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    return model, pipeline.split(model, (x,)), x


def same_as_plain(seq: nn.Module, plain: nn.Module, x: Tensor) -> None:
    """Outputs and every gradient of ``seq`` (on the model it shares) equal ``plain``'s."""
    seq.zero_grad()
    plain.zero_grad()
    found, expected = seq(x), plain(x)
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-14)
    found.square().sum().backward()
    expected.square().sum().backward()
    assert_same(gradients(seq), gradients(plain))


def test_a_dropout_p_changed_after_the_split_is_followed() -> None:
    model = gpt2(embd_pdrop=0.3).train()
    ids, mask, target = tokens(4, 8)
    seq = pipeline.split(model, (ids,), {"attention_mask": mask})
    seq.transformer.drop.p = 0.0
    plain = twin(model)
    out, expected = seq(ids, attention_mask=mask), plain(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=1e-14)
    lm_loss(out, target).backward()
    lm_loss(expected, target).backward()
    assert_same(gradients(model), gradients(plain))
    # A pipe built on it follows it too, recomputation included.
    model.zero_grad()
    plain.zero_grad()
    pipe = Pipe(seq, [2, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    kwargs = {"attention_mask": mask}
    loss = pipe.step(ids, target, lm_loss, kwargs=kwargs, schedule="1f1b")
    pipe.close()
    expected_loss = lm_loss(plain(ids, attention_mask=mask), target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-14)
    assert_same(gradients(model), gradients(plain))
    # And up: the embedding dropout zeroes half of the embedded entries, not 3 in 10.
    seq.transformer.drop.p = 0.5
    (embedded,) = [value for value in seq[0](ids, attention_mask=mask) if _hidden(value)]
    assert 0.4 < float((embedded == 0).double().mean()) < 0.6


def _hidden(value: object) -> bool:
    return isinstance(value, Tensor) and value.dim() == 3 and value.is_floating_point()


def test_an_attribute_changed_after_the_split_is_refused() -> None:
    model, seq, x = split_model()
    model.temperature = 2.0
    with pytest.raises(RuntimeError) as error:
        seq(x)
    message = str(error.value)
    assert "attribute 'temperature' of the model (Model) is 2.0" in message
    assert "split with 1.0" in message and "split the model again" in message
    model.temperature = 1.0
    same_as_plain(seq, copy.deepcopy(model), x)


def test_a_tensor_attribute_replaced_after_the_split_is_refused() -> None:
    model, seq, x = split_model()
    model.scale = torch.tensor(3.0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"attribute 'scale' of the model .* another tensor"):
        seq(x)


def hooks_of_three_kinds(model: nn.Module, calls: list[str]) -> list[tuple[str, object]]:
    forward = model.head.register_forward_hook(lambda *_: calls.append("head"))
    backward = model.emb.register_full_backward_hook(lambda *_: calls.append("emb"))
    pre = model.head.register_forward_pre_hook(lambda *_: calls.append("pre"))
    return [
        ("module 'head' (Linear) has forward hooks", forward),
        ("module 'emb' (Linear) has full backward hooks", backward),
        ("module 'head' (Linear) has forward pre hooks", pre),
    ]


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["forward", "full backward", "forward pre"])
def test_hooks_registered_after_the_split_are_refused(kind: int) -> None:
    model, seq, x = split_model()
    calls: list[str] = []
    hooks = hooks_of_three_kinds(model, calls)
    expected, keep = hooks[kind]
    for _, handle in hooks[:kind] + hooks[kind + 1 :]:
        handle.remove()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError) as error:
        seq(x)
    assert expected in str(error.value) and "after the split" in str(error.value)
    assert calls == []
    keep.remove()  # type: ignore[attr-defined]
    same_as_plain(seq, copy.deepcopy(model), x)


def test_a_global_hook_registered_after_the_split_is_refused() -> None:
    _, seq, x = split_model()
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        with pytest.raises(RuntimeError, match="global module hooks are registered"):
            seq(x)
    finally:
        handle.remove()


@pytest.mark.parametrize("where", ["split model", "model", "block"])
def test_a_module_replaced_after_the_split_is_refused(where: str) -> None:
    model, seq, x = split_model()
    if where == "split model":
        seq.head = nn.Linear(8, 5).double()
        expected = "module 'head' (Linear) was replaced by Linear"
    elif where == "model":
        model.head = nn.Linear(8, 5).double()
        expected = "module 'head' (Linear) was replaced by Linear"
    else:
        model.blocks[1] = Block().double()
        expected = "module 'blocks.1' (Block) was replaced by Block"
    with pytest.raises(RuntimeError) as error:
        seq(x)
    assert expected in str(error.value) and "split the model again" in str(error.value)


def test_a_pipe_sees_the_same_refusals() -> None:
    model, seq, x = split_model()
    pipe = Pipe(seq, [2, len(seq) - 2], devices=["cpu", "cpu"], chunks=2)
    plain = copy.deepcopy(model)
    model.temperature = plain.temperature = 2.0
    with pytest.raises(RuntimeError, match="attribute 'temperature'"):
        pipe(x)
    with pytest.raises(RuntimeError, match="attribute 'temperature'"):
        pipe.step(x, torch.zeros(4, 3, dtype=torch.float64), F.mse_loss)
    model.temperature = plain.temperature = 1.0
    handle = model.head.register_forward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match=r"module 'head' .* has forward hooks"):
        pipe(x)
    handle.remove()
    # Unchanged again: the pipe gives the plain model's results.
    torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-14)
    pipe.close()


class RebindsBuffer(Model):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        self.ema = self.ema * 0.9 + h.detach().mean(0) * 0.1
        for block in self.blocks:
            h = block(h - self.ema)
        return self.head(h)


class CountsCalls(Model):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def forward(self, x: Tensor) -> Tensor:
        self.steps += 1
        return super().forward(x)


def test_a_buffer_rebound_by_captured_code_is_refused_at_split() -> None:
    model = RebindsBuffer().double()
    with pytest.raises(ValueError) as error:
        pipeline.split(model, (torch.randn(4, 4, dtype=torch.float64),))
    message = str(error.value)
    assert "test_follows_model.py" in message
    assert "`self.ema = self.ema * 0.9 + h.detach().mean(0) * 0.1`" in message
    assert "assigns buffer 'ema' of the model (RebindsBuffer)" in message and "points" in message
    assert torch.equal(model.ema, torch.zeros(8, dtype=torch.float64))


def test_an_attribute_assigned_by_captured_code_is_refused_and_put_back() -> None:
    model = CountsCalls().double()
    with pytest.raises(ValueError, match=r"`self.steps \+= 1`.* assigns attribute 'steps'"):
        pipeline.split(model, (torch.randn(4, 4, dtype=torch.float64),))
    assert model.steps == 0


class CachesATable(Block):
    """A block that makes a tensor at its first call and keeps it (rope caches do)."""

    def forward(self, x: Tensor) -> Tensor:
        if getattr(self, "table", None) is None:
            self.table = torch.linspace(1.0, 2.0, 8, dtype=x.dtype)
        return x + torch.tanh(self.linear(x)) * self.table


class RegistersATable(Block):
    """A block that registers a buffer at its first call."""

    def forward(self, x: Tensor) -> Tensor:
        if "table" not in self._buffers:
            self.register_buffer("table", torch.linspace(1.0, 2.0, 8, dtype=x.dtype))
        return x + torch.tanh(self.linear(x)) * self.table


@pytest.mark.parametrize("block", [CachesATable, RegistersATable])
def test_a_tensor_a_block_keeps_from_its_first_call_is_not_left_fake_on_the_model(
    block: type[nn.Module],
) -> None:
    # Blocks run as themselves, their fake runs at split unrecorded: the table made in
    # one stayed on the model as a fake tensor, and the model and the split model both
    # returned fake tensors, with no error (or failed at the first step, on a buffer).
    model = Model().double()
    model.blocks = nn.ModuleList(block() for _ in range(3)).double()
    made = copy.deepcopy(model)
    x = torch.randn(4, 4, dtype=torch.float64)
    made(x)  # a model called before: its block holds a real table, which stays
    for kept in (model, made):
        before = getattr(kept.blocks[1], "table", None)
        plain = copy.deepcopy(kept)
        seq = pipeline.split(kept, (x,))
        assert getattr(kept.blocks[1], "table", None) is before
        same_as_plain(seq, plain, x)
        torch.testing.assert_close(kept(x), plain(x), rtol=0, atol=0)


class Average(nn.Module):
    """A running mean of its input, rebound at each call: runs as itself when named in points."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, h: Tensor) -> Tensor:
        self.ema = self.ema * 0.9 + h.detach().mean(0) * 0.1
        return h - self.ema


class AveragesInAModule(Model):
    def __init__(self) -> None:
        super().__init__()
        self.average = Average()

    def forward(self, x: Tensor) -> Tensor:
        h = self.average(self.emb(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_rebinding_in_a_module_named_in_points_is_followed() -> None:
    model = AveragesInAModule().double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 4, dtype=torch.float64)
    seq = pipeline.split(model, (x,), points=["average", "blocks.0", "blocks.2"])
    for _ in range(3):
        same_as_plain(seq, plain, x)
    torch.testing.assert_close(model.average.ema, plain.average.ema, rtol=0, atol=1e-15)
    assert float(plain.average.ema.abs().max()) > 0


def test_an_unchanged_split_gpt2_runs_many_calls() -> None:
    model = gpt2()
    ids, mask, _ = tokens(4, 8)
    seq = pipeline.split(model, (ids,), {"attention_mask": mask})
    plain = twin(model)
    calls: list[int] = []
    # What the pieces follow: a hook on a block, the mode, loaded weights.
    model.transformer.h[1].register_forward_hook(lambda *_: calls.append(1))
    plain.transformer.h[1].register_forward_hook(lambda *_: calls.append(1))
    seq.eval()
    plain.eval()
    seq.load_state_dict(plain.state_dict())
    for _ in range(2):
        out, expected = seq(ids, attention_mask=mask), plain(ids, attention_mask=mask)
        torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=1e-14)
    assert calls == [1, 1, 1, 1]


def test_a_config_value_changed_after_the_split_is_refused() -> None:
    model = gpt2()
    ids, mask, _ = tokens(2, 5)
    seq = pipeline.split(model, (ids,), {"attention_mask": mask})
    plain = twin(model)
    model.config.output_hidden_states = True
    with pytest.raises(RuntimeError) as error:
        seq(ids, attention_mask=mask)
    assert "model.config.output_hidden_states (of a GPT2Config) is True" in str(error.value)
    assert "split with False" in str(error.value)
    model.config.output_hidden_states = False
    expected = plain(ids, attention_mask=mask).logits
    torch.testing.assert_close(seq(ids, attention_mask=mask).logits, expected)
    # Capture put the config's class back as it was.
    assert "__getattribute__" not in vars(type(model.config))


class OwnTensors(Model):
    """A parameter and a buffer of the model itself, read by the captured code."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8))
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + (self.pos + self.shift).sum()


@pytest.mark.parametrize("change", ["parameter", "buffer"])
def test_the_models_own_tensor_replaced_after_the_split_is_refused(change: str) -> None:
    model = OwnTensors().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    seq = pipeline.split(model, (x,))
    pipe = Pipe(seq, [2, len(seq) - 2], devices=["cpu", "cpu"], chunks=2)
    if change == "parameter":  # the pipe and an optimizer of it would train the old one
        model.pos = nn.Parameter(torch.zeros(8, dtype=torch.float64))
    else:
        model.shift = torch.zeros(8, dtype=torch.float64)
    for call in (lambda: seq(x), lambda: pipe(x)):
        with pytest.raises(RuntimeError) as error:
            call()
        message = str(error.value)
        assert (
            f"the model's {change} '{'pos' if change == 'parameter' else 'shift'}' was " in message
        )
        assert "replaced after the split" in message and "copy new values into it" in message
    pipe.close()


def test_weights_untied_after_the_split_are_refused_and_retied_ones_run() -> None:
    model = Model().double()
    model.head = nn.Linear(8, 8).double()
    model.emb = nn.Linear(8, 8).double()
    model.head.weight = model.emb.weight  # tied: the captured code reads one tensor
    x = torch.randn(4, 8, dtype=torch.float64)
    seq = pipeline.split(model, (x,))
    pipe = Pipe(seq, [2, len(seq) - 2], devices=["cpu", "cpu"], chunks=2)
    plain = copy.deepcopy(model)
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    for call in (lambda: seq(x), lambda: pipe(x)):
        with pytest.raises(
            RuntimeError, match=r"'(emb|head).weight' and '(head|emb).weight' were one tensor"
        ):
            call()
    model.head.weight = model.emb.weight  # tied again: the plain model's results
    torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=1e-14)
    pipe.close()


class TiedIntoBlock(Model):
    """An output layer whose weight is a block's: the block runs as itself, reading its own."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 8)
        self.out.weight = self.blocks[0].linear.weight

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.out(self.emb(x)).sum()


def test_a_weight_tied_into_a_block_may_be_untied() -> None:
    model = TiedIntoBlock().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    seq = pipeline.split(model, (x,))
    model.out.weight = nn.Parameter(model.out.weight.detach() * 2)
    same_as_plain(seq, copy.deepcopy(model), x)


def test_autocast_that_changes_a_blocks_dtype_is_refused_naming_autocast() -> None:
    x = torch.randn(4, 4)  # float32: autocast on the CPU casts its matrix products to bfloat16
    seq = pipeline.split(Model(), (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError) as error:
        seq(x)
    message = str(error.value)
    assert "returned a torch.bfloat16 tensor" in message and "autocast is on here" in message
    seq(x)  # without autocast, as split


class HeadBeforeBlocks(nn.Module):
    """A head tied to a block's weight, registered first: export names the tensor after the
    head, or after the block, by the order of registration; either way it is read as one."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        if not head_first:
            self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.blocks[1].linear.weight

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("untie", ["head", "block"])
def test_a_head_tied_into_a_block_untied_is_followed_or_refused(untie: str) -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    for head_first in (False, True):
        model = HeadBeforeBlocks(head_first).double()
        seq = pipeline.split(model, (x,))
        owner = model.head if untie == "head" else model.blocks[1].linear
        owner.weight = nn.Parameter(owner.weight.detach() * 2)
        if head_first:  # the captured head reads the tensor by the block's name: refused
            with pytest.raises(RuntimeError, match="were one tensor when the model was split"):
                seq(x)
        else:  # by the head's: the block reads its own, the head its own
            same_as_plain(seq, copy.deepcopy(model), x)


def test_the_models_own_buffer_in_another_dtype_is_refused_naming_the_dtype() -> None:
    model = OwnTensors().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    seq = pipeline.split(model, (x,))
    model.float()
    with pytest.raises(RuntimeError, match=r"'shift' is torch\.float32, but the model was split"):
        seq(x.float())
