"""Every >>> example in the docstrings of pipeline and balance runs, and shows what it asserts."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import balance
import pipeline


def _modules() -> list[str]:
    names = []
    for package in (pipeline, balance):
        names.append(package.__name__)
        prefix = package.__name__ + "."
        names += [info.name for info in pkgutil.walk_packages(package.__path__, prefix)]
    return sorted(names)


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    found = []
    for name in _modules():
        # import_module: in pipeline's namespace, pipeline.trace is the function.
        found += [test for test in finder.find(importlib.import_module(name)) if test.examples]
    return sorted(found, key=lambda test: test.name)


DOCTESTS = _doctests()


def test_the_package_shows_its_examples() -> None:
    assert len(DOCTESTS) >= 24, [test.name for test in DOCTESTS]


@pytest.mark.parametrize("test", DOCTESTS, ids=lambda test: test.name)
def test_docstring_example(test: doctest.DocTest) -> None:
    assert any(example.want for example in test.examples), (
        f"{test.name}: its examples show no result, so they assert nothing; show one"
    )
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    assert runner.run(test).failed == 0
