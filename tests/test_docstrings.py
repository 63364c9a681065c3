"""Runs every `>>>` example in lamina's own docstrings."""

import doctest
import importlib
import pkgutil

import pytest

import lamina

MODULES = sorted(info.name for info in pkgutil.walk_packages(lamina.__path__, prefix="lamina."))


@pytest.mark.parametrize("name", ["lamina", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={}):
        if test.name.split(".")[0] != "lamina":
            continue
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {name}"
