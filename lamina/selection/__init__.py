"""Filters and selection: which variables a filter names, split/merge/mask, grad by filter."""

from .autodiff import DiffState as DiffState
from .autodiff import grad as grad
from .autodiff import value_and_grad as value_and_grad
from .filters import All as All
from .filters import Any as Any
from .filters import Everything as Everything
from .filters import Not as Not
from .filters import Nothing as Nothing
from .filters import OfType as OfType
from .filters import PathContains as PathContains
from .filters import WithTag as WithTag
from .filters import to_predicate as to_predicate
from .split import filter_variables as filter_variables
from .split import mask as mask
from .split import merge as merge
from .split import split as split
from .submodule import put_variables as put_variables
from .submodule import take_variables as take_variables
