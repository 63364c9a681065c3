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

from . import data as data
from . import initializers as initializers
from . import interop as interop
from . import io as io
from . import utils as utils
from ._core.autodiff import DiffState as DiffState
from ._core.autodiff import grad as grad
from ._core.autodiff import value_and_grad as value_and_grad
from ._core.errors import CheckpointError as CheckpointError
from ._core.errors import FrozenModuleError as FrozenModuleError
from ._core.errors import ImmutableVariableError as ImmutableVariableError
from ._core.errors import RngError as RngError
from ._core.errors import TraceContextError as TraceContextError
from ._core.errors import UnboundVariableError as UnboundVariableError
from ._core.errors import VariablesError as VariablesError
from ._core.filters import All as All
from ._core.filters import Any as Any
from ._core.filters import Everything as Everything
from ._core.filters import Not as Not
from ._core.filters import Nothing as Nothing
from ._core.filters import OfType as OfType
from ._core.filters import PathContains as PathContains
from ._core.filters import WithTag as WithTag
from ._core.filters import to_predicate as to_predicate
from ._core.grad_rule import grad_rule as grad_rule
from ._core.gradcheck import check_gradients as check_gradients
from ._core.lift import Carry as Carry
from ._core.lift import StateAxes as StateAxes
from ._core.lift import checkpoint as checkpoint
from ._core.lift import cond as cond
from ._core.lift import fori_loop as fori_loop
from ._core.lift import remat as remat
from ._core.lift import scan as scan
from ._core.lift import split_rngs as split_rngs
from ._core.lift import switch as switch
from ._core.lift import vmap as vmap
from ._core.lift import while_loop as while_loop
from ._core.module import Module as Module
from ._core.records import Probe as Probe
from ._core.records import capture_intermediates as capture_intermediates
from ._core.records import perturb as perturb
from ._core.records import probe as probe
from ._core.records import sow as sow
from ._core.rng import PRNGKeys as PRNGKeys
from ._core.rng import next_rng_key as next_rng_key
from ._core.selection import filter_variables as filter_variables
from ._core.selection import mask as mask
from ._core.selection import merge as merge
from ._core.selection import split as split
from ._core.sharding import shardings as shardings
from ._core.submodule import put_variables as put_variables
from ._core.submodule import take_variables as take_variables
from ._core.transform import AssignReport as AssignReport
from ._core.transform import Transformed as Transformed
from ._core.transform import apply as apply
from ._core.transform import assign_variables as assign_variables
from ._core.transform import init as init
from ._core.transform import transform as transform
from ._core.variables import BatchStat as BatchStat
from ._core.variables import Cache as Cache
from ._core.variables import Parameter as Parameter
from ._core.variables import State as State
from .activations import *  # noqa: F403 - the activation functions, flat
from .interop import from_torch as from_torch
from .interop import register_torch as register_torch
from .interop import to_torch as to_torch
from .io import load as load
from .io import save as save
from .model_summary import Summary as Summary
from .model_summary import summary as summary
from .nn import RNN as RNN
from .nn import BatchNorm as BatchNorm
from .nn import Bidirectional as Bidirectional
from .nn import Conv as Conv
from .nn import ConvLocal as ConvLocal
from .nn import ConvLSTMCell as ConvLSTMCell
from .nn import ConvTranspose as ConvTranspose
from .nn import Dense as Dense
from .nn import DenseGeneral as DenseGeneral
from .nn import Dropout as Dropout
from .nn import Einsum as Einsum
from .nn import Embed as Embed
from .nn import GroupNorm as GroupNorm
from .nn import GRUCell as GRUCell
from .nn import InstanceNorm as InstanceNorm
from .nn import LayerNorm as LayerNorm
from .nn import LoRA as LoRA
from .nn import LoRAParam as LoRAParam
from .nn import LSTMCell as LSTMCell
from .nn import MGUCell as MGUCell
from .nn import MultiHeadAttention as MultiHeadAttention
from .nn import OptimizedLSTMCell as OptimizedLSTMCell
from .nn import RMSNorm as RMSNorm
from .nn import Sequential as Sequential
from .nn import SimpleCell as SimpleCell
from .nn import SpectralNorm as SpectralNorm
from .nn import Stack as Stack
from .nn import WeightNorm as WeightNorm
from .nn import avg_pool as avg_pool
from .nn import combine_masks as combine_masks
from .nn import dot_product_attention as dot_product_attention
from .nn import dot_product_attention_weights as dot_product_attention_weights
from .nn import dropout as dropout
from .nn import make_attention_mask as make_attention_mask
from .nn import make_causal_mask as make_causal_mask
from .nn import max_pool as max_pool
from .nn import merge_lora as merge_lora
from .nn import min_pool as min_pool
from .nn import pool as pool

__version__ = "0.1.0"
