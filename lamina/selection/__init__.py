"""Selection: which of a model's variables a filter names, and what to do with them.

A room beside the core that reads a model's `Plan` (its declarations, paths and modules) and
the variables dict; it stores nothing. `filters.py` holds the filter language
(`to_predicate`, `WithTag`, `OfType`...); `partition.py` groups variables by filters
(`split`, `merge`, `filter_variables`, `mask`); `autodiff.py` differentiates part of a
variables argument (`DiffState`, `grad`, `value_and_grad`); `submodule.py` takes a
submodule's slice of the variables out and puts it back (`take_variables`,
`put_variables`); `surgery.py` edits a copy of the model by filter (`replace` submodules,
`freeze` parameters). It imports only the core.
"""

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
from .partition import filter_variables as filter_variables
from .partition import mask as mask
from .partition import merge as merge
from .partition import split as split
from .submodule import put_variables as put_variables
from .submodule import take_variables as take_variables
from .surgery import freeze as freeze
from .surgery import replace as replace
