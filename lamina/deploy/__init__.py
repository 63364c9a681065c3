"""Exported artifacts: a trained model as a file that runs without lamina.

One idea: a model, its variables and example arguments become one pure inference function of
arrays (`inference.inference_function`: static arguments closed over, variables baked in or
taken first, symbolic batch dimensions, training refused unless asked for, decoding caches in
and out); a format then writes that function. `export` writes StableHLO through
``jax.export`` (loaded by JAX and flatbuffers alone, or `load_exported`); `export_onnx` writes
ONNX through the ``jax2onnx`` package, replaying lamina's own jaxpr (`jaxpr_replay`) and
checking the file with ONNX Runtime before it is written. Both check the target path first
(`io._atomic.check_target`) and write atomically (`io._atomic.atomic_file`).
"""

from .onnx_export import export_onnx as export_onnx
from .stablehlo import export as export
from .stablehlo import load_exported as load_exported
