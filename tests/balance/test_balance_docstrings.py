"""The examples in the docstrings of the balance package run and print what they show."""

import doctest
from types import ModuleType

import pytest

import balance
from balance import blockpartition


@pytest.mark.parametrize("module", [balance, blockpartition], ids=lambda module: module.__name__)
def test_docstring_examples(module: ModuleType) -> None:
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0
    assert results.failed == 0
