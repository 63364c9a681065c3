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
from . import models as models
from . import utils as utils
from ._core.errors import CheckpointError as CheckpointError
from ._core.errors import ExportError as ExportError
from ._core.errors import FrozenModuleError as FrozenModuleError
from ._core.errors import ImmutableVariableError as ImmutableVariableError
from ._core.errors import RngError as RngError
from ._core.errors import TraceContextError as TraceContextError
from ._core.errors import UnboundVariableError as UnboundVariableError
from ._core.errors import VariablesError as VariablesError
from ._core.module import Module as Module
from ._core.rng import PRNGKeys as PRNGKeys
from ._core.rng import next_rng_key as next_rng_key
from ._core.transform import AssignReport as AssignReport
from ._core.transform import Transformed as Transformed
from ._core.transform import apply as apply
from ._core.transform import assign_variables as assign_variables
from ._core.transform import init as init
from ._core.transform import transform as transform
from ._core.variables import BatchStat as BatchStat
from ._core.variables import Cache as Cache
from ._core.variables import FrozenParam as FrozenParam
from ._core.variables import Parameter as Parameter
from ._core.variables import State as State
from .activations import *  # noqa: F403 - the activation functions, flat
from .debug import check_gradients as check_gradients
from .debug import grad_rule as grad_rule
from .deploy import export as export
from .deploy import export_onnx as export_onnx
from .deploy import load_exported as load_exported
from .interop import from_torch as from_torch
from .interop import register_torch as register_torch
from .interop import to_torch as to_torch
from .io import load as load
from .io import save as save
from .lift import Carry as Carry
from .lift import StateAxes as StateAxes
from .lift import checkpoint as checkpoint
from .lift import cond as cond
from .lift import fori_loop as fori_loop
from .lift import remat as remat
from .lift import scan as scan
from .lift import split_rngs as split_rngs
from .lift import switch as switch
from .lift import vmap as vmap
from .lift import while_loop as while_loop
from .model_summary import Summary as Summary
from .model_summary import summary as summary
from .models import generate as generate
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
from .nn import GatedMLP as GatedMLP
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
from .nn import RotaryEmbedding as RotaryEmbedding
from .nn import Sequential as Sequential
from .nn import SimpleCell as SimpleCell
from .nn import SpectralNorm as SpectralNorm
from .nn import Stack as Stack
from .nn import WeightNorm as WeightNorm
from .nn import apply_rotary as apply_rotary
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
from .nn import rope_frequencies as rope_frequencies
from .precision import DynamicLossScale as DynamicLossScale
from .precision import Policy as Policy
from .precision import all_finite as all_finite
from .precision import with_policy as with_policy
from .records import Probe as Probe
from .records import capture_intermediates as capture_intermediates
from .records import perturb as perturb
from .records import probe as probe
from .records import sow as sow
from .rendering import display as display
from .rendering import render_html as render_html
from .selection import All as All
from .selection import Any as Any
from .selection import DiffState as DiffState
from .selection import Everything as Everything
from .selection import Not as Not
from .selection import Nothing as Nothing
from .selection import OfType as OfType
from .selection import PathContains as PathContains
from .selection import WithTag as WithTag
from .selection import filter_variables as filter_variables
from .selection import freeze as freeze
from .selection import grad as grad
from .selection import mask as mask
from .selection import merge as merge
from .selection import put_variables as put_variables
from .selection import replace as replace
from .selection import split as split
from .selection import take_variables as take_variables
from .selection import to_predicate as to_predicate
from .selection import value_and_grad as value_and_grad
from .sharding import pmean as pmean
from .sharding import shardings as shardings

__version__ = "0.1.0"
