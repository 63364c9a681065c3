"""Layers, one concept per file."""

from .attention import combine_masks as combine_masks
from .attention import dot_product_attention as dot_product_attention
from .attention import make_attention_mask as make_attention_mask
from .attention import make_causal_mask as make_causal_mask
from .batch_normalization import BatchNorm as BatchNorm
from .cells import GRUCell as GRUCell
from .cells import LSTMCell as LSTMCell
from .combinators import Sequential as Sequential
from .conv import Conv as Conv
from .conv import ConvTranspose as ConvTranspose
from .linear import Dense as Dense
from .linear import Embed as Embed
from .lora import LoRA as LoRA
from .lora import LoRAParam as LoRAParam
from .lora import merge_lora as merge_lora
from .multi_head_attention import MultiHeadAttention as MultiHeadAttention
from .norm import GroupNorm as GroupNorm
from .norm import LayerNorm as LayerNorm
from .norm import RMSNorm as RMSNorm
from .pool import avg_pool as avg_pool
from .pool import max_pool as max_pool
from .pool import min_pool as min_pool
from .recurrent import RNN as RNN
from .regularization import Dropout as Dropout
from .regularization import dropout as dropout
from .stack import Stack as Stack
