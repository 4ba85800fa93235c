"""transformers' outputs recorded by hooks (``output_hidden_states`` and the like): refused.

transformers collects them with hooks on the blocks and inside them, which a
split model's pieces do not feed. Before the refusal, a model whose
recording hooks were installed by an earlier plain call split silently with
``hidden_states == ()`` where the plain model gives one per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from split_models import assert_same, gpt2, gradients, llama, lm_loss, tokens, twin
from torch import nn

import pipeline
from pipeline.split import SplitError

MODELS: list[Callable[[], nn.Module]] = [gpt2, llama]


@pytest.mark.parametrize("make", MODELS, ids=["gpt2", "llama"])
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
@pytest.mark.parametrize("installed", [False, True], ids=["fresh", "after_a_plain_call"])
def test_an_output_recorded_by_hooks_is_refused_naming_the_flag(
    make: Callable[[], nn.Module], flag: str, installed: bool
) -> None:
    model = make()
    ids, _, _ = tokens(2, 6)
    if installed:  # the recorder's hooks are then on the blocks already
        model(ids, **{flag: True})
    with pytest.raises(SplitError) as error:
        pipeline.split(model, (ids,), {flag: True})
    message = str(error.value)
    assert message.startswith(f"{flag}=True was passed, but split cannot give that output")
    assert f"Pass {flag}=False in the example's kwargs" in message


def test_the_config_s_flag_is_refused_and_an_explicit_false_splits_equal_to_plain() -> None:
    model = gpt2(output_hidden_states=True)
    plain = twin(model)
    ids, _, target = tokens(3, 5)
    with pytest.raises(SplitError, match="the model's config sets output_hidden_states, but"):
        pipeline.split(model, (ids,))
    seq = pipeline.split(model, (ids,), {"output_hidden_states": False})
    out = seq(ids, output_hidden_states=False)
    expected = plain(ids, output_hidden_states=False)
    assert out.hidden_states is None and expected.hidden_states is None
    lm_loss(out, target).backward()
    lm_loss(expected, target).backward()
    assert_same(gradients(model), gradients(plain))
