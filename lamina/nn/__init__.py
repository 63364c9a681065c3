"""Layers, one concept per file."""

# Metoryx's `nn` namespace also holds the base class, the activations and the initializers.
from .. import initializers as initializers
from .._core.module import Module as Module
from ..activations import *  # noqa: F403
from .attention import combine_masks as combine_masks
from .attention import dot_product_attention as dot_product_attention
from .attention import dot_product_attention_weights as dot_product_attention_weights
from .attention import make_attention_mask as make_attention_mask
from .attention import make_causal_mask as make_causal_mask
from .batch_normalization import BatchNorm as BatchNorm
from .bidirectional import Bidirectional as Bidirectional
from .combinators import Sequential as Sequential
from .conv import Conv as Conv
from .conv import ConvTranspose as ConvTranspose
from .conv_local import ConvLocal as ConvLocal
from .conv_lstm import ConvLSTMCell as ConvLSTMCell
from .dense_general import DenseGeneral as DenseGeneral
from .einsum import Einsum as Einsum
from .group_normalization import GroupNorm as GroupNorm
from .group_normalization import InstanceNorm as InstanceNorm
from .gru_cells import GRUCell as GRUCell
from .gru_cells import MGUCell as MGUCell
from .layer_normalization import LayerNorm as LayerNorm
from .layer_normalization import RMSNorm as RMSNorm
from .linear import Dense as Dense
from .linear import Embed as Embed
from .lora import LoRA as LoRA
from .lora import LoRAParam as LoRAParam
from .lora import merge_lora as merge_lora
from .lstm_cells import LSTMCell as LSTMCell
from .lstm_cells import OptimizedLSTMCell as OptimizedLSTMCell
from .multi_head_attention import MultiHeadAttention as MultiHeadAttention
from .pool import avg_pool as avg_pool
from .pool import max_pool as max_pool
from .pool import min_pool as min_pool
from .pool import pool as pool
from .recurrent import RNN as RNN
from .regularization import Dropout as Dropout
from .regularization import dropout as dropout
from .simple_cell import SimpleCell as SimpleCell
from .stack import Stack as Stack
from .weight_normalization import SpectralNorm as SpectralNorm
from .weight_normalization import WeightNorm as WeightNorm
