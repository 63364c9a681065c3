"""Published decoder models (Llama, Mistral, Qwen2, Qwen3, Gemma) and their checkpoints.

``lamina.models.from_pretrained(folder)`` reads a Hugging Face folder (``config.json`` and
safetensors files) into ``(model, variables)`` without PyTorch; `save_pretrained` writes one
back; `lamina.generate` decodes from a model with a static KV cache.
"""

from .checkpoints import from_pretrained as from_pretrained
from .checkpoints import save_pretrained as save_pretrained
from .config import ModelConfig as ModelConfig
from .generation import generate as generate
from .llama import CausalLM as CausalLM
from .llama import DecoderBlock as DecoderBlock
from .llama import init_cache as init_cache
from .tokenizers import load_tokenizer as load_tokenizer
