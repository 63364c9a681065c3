"""`Lifted`: the base of lifted functions, which run their transform when called in a model."""

from __future__ import annotations

import abc
import copy
import functools
from collections.abc import Callable
from typing import Any

from .axes import Splittable, split_of, split_rngs


class Lifted(Splittable):
    """A lifted function; calling it inside a model's method runs the transform."""

    kind = ""
    iterates = True  # whether a split of the keys means anything (vmap, scan, loops)
    split: split_rngs | None

    def __init__(self, fn: Callable[..., Any], split_argument: Any = None):
        if not callable(fn):
            raise TypeError(f"lm.{self.kind} transforms a function, got {type(fn).__name__}.")
        fn, split = split_of(f"lm.{self.kind}", fn, split_argument)
        self.fn = fn
        self.split = None
        # names and docs only: the wrapped callable's __dict__ must not overwrite ours
        functools.update_wrapper(self, fn, updated=())
        if split is not None:
            self._check_split(split)
        self.split = split

    def _check_split(self, split: split_rngs) -> None:
        if not self.iterates:
            raise TypeError(
                f"lm.{self.kind} runs its function once, so there is nothing to split keys "
                f"over ({split!r}); split_rngs goes on lm.vmap, lm.scan, lm.fori_loop or "
                f"lm.while_loop."
            )

    def with_split(self, split: split_rngs) -> Lifted:
        """A copy of this lifted function that splits keys as `split` says."""
        if self.split is not None:
            raise TypeError(
                f"this lm.{self.kind} already splits its keys ({self.split!r}); give the "
                f"split once, not also {split!r}."
            )
        self._check_split(split)
        lifted = copy.copy(self)
        lifted.split = split
        return lifted

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the transform (each kind implements it)."""

    def __repr__(self) -> str:
        return f"<lamina {self.kind} of {getattr(self.fn, '__name__', type(self.fn).__name__)}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As a decorator of a method: bind `self` like a function does.
        return self if instance is None else functools.partial(self.__call__, instance)


def decorator_or(fn: Callable[..., Any] | None, make: Callable[[Callable], Any]) -> Any:
    """``make(fn)``, or `make` itself (a decorator) when `fn` is None."""
    return make if fn is None else make(fn)
