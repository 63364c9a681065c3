"""lamina: neural networks for JAX, defined as Python objects, run as pure functions.

Example:
    >>> import jax, jax.numpy as jnp, lamina as lm
    >>> class Mlp(lm.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layer1 = lm.Dense(4, 8)
    ...         self.layer2 = lm.Dense(8, 2)
    ...     def __call__(self, x):
    ...         return self.layer2(lm.relu(self.layer1(x)))
    >>> init, apply = lm.transform(Mlp())
    >>> variables = init(jax.random.key(0))
    >>> outputs, new_variables = apply(variables, None, jnp.ones((1, 4)))
    >>> outputs.shape
    (1, 2)
"""

from . import initializers as initializers
from . import utils as utils
from ._core.errors import FrozenModuleError as FrozenModuleError
from ._core.errors import ImmutableVariableError as ImmutableVariableError
from ._core.errors import RngError as RngError
from ._core.errors import UnboundVariableError as UnboundVariableError
from ._core.errors import VariablesError as VariablesError
from ._core.module import Module as Module
from ._core.rng import PRNGKeys as PRNGKeys
from ._core.rng import next_rng_key as next_rng_key
from ._core.transform import Transformed as Transformed
from ._core.transform import assign_variables as assign_variables
from ._core.transform import transform as transform
from ._core.variables import BatchStat as BatchStat
from ._core.variables import Cache as Cache
from ._core.variables import Parameter as Parameter
from ._core.variables import State as State
from .activations import *  # noqa: F403 - the activation functions, flat
from .nn import Dense as Dense

__version__ = "0.1.0"
