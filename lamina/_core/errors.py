"""The exceptions a user can meet (how their messages write paths: `checks.format_path`)."""

from __future__ import annotations


class VariablesError(ValueError):
    """Variables that do not fit the model: missing, unexpected or misshapen entries.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dense(2, 3))
        >>> try:
        ...     apply({"params": {"kernel": jnp.ones((2, 3))}}, None, jnp.ones((1, 2)))
        ... except lm.VariablesError as error:
        ...     print(str(error).splitlines()[1].strip())
        missing (1): params/bias
    """


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint: truncated, corrupted, or in another format.

    Also what `lm.save` raises when it cannot write the file (a full disk, a file-size limit),
    naming the file and the bytes it needs.

    Example:
        >>> import os, tempfile, lamina as lm
        >>> path = os.path.join(tempfile.mkdtemp(), "notes.safetensors")
        >>> with open(path, "w") as file:
        ...     _ = file.write("not a checkpoint")
        >>> try:
        ...     lm.load(path)
        ... except lm.CheckpointError:
        ...     print("refused")
        refused
    """


class ExportError(ValueError):
    """A model that cannot be exported as asked (`lm.export`, `lm.export_onnx`).

    Raised before anything is written: exporting in training mode (dropout drawing keys,
    batch statistics updated) without ``allow_training=True``, an output container an
    artifact cannot hold, an operation ONNX cannot express (naming the layer's path), a file
    that is not an exported artifact (`lm.load_exported`).

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> model = lm.Dropout(0.5)
        >>> try:
        ...     lm.export(model, {}, jnp.ones((2, 3)), True)  # is_training=True
        ... except lm.ExportError as error:
        ...     print("refused:", "training mode" in str(error))
        refused: True
    """


class FrozenModuleError(AttributeError):
    """An attribute of a module was assigned while the module was being applied.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> class Remembers(lm.Module):
        ...     def __call__(self, x):
        ...         self.last = x  # Python state would not survive jit: refused
        ...         return x
        >>> init, apply = lm.transform(Remembers())
        >>> try:
        ...     apply({}, None, jnp.ones(2))
        ... except lm.FrozenModuleError:
        ...     print("refused")
        refused
    """


class ImmutableVariableError(AttributeError):
    """An immutable variable (a `Parameter`, or a `State` with `mutable=False`) was written.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Overwrites(lm.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = lm.Parameter((2,), lm.initializers.zeros())
        ...     def __call__(self, x):
        ...         self.w.value = x
        ...         return x
        >>> init, apply = lm.transform(Overwrites())
        >>> try:
        ...     apply(init(jax.random.key(0)), None, jnp.ones(2))
        ... except lm.ImmutableVariableError:
        ...     print("refused")
        refused
    """


class RngError(ValueError):
    """A random key was asked for that the call was not given.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dropout(0.5))
        >>> try:
        ...     apply({}, None, jnp.ones(4), is_training=True)  # dropout needs a key
        ... except lm.RngError:
        ...     print("refused")
        refused
    """


class UnboundVariableError(RuntimeError):
    """A variable's value was read where it has none: outside `init`/`apply`.

    Example:
        >>> import lamina as lm
        >>> layer = lm.Dense(2, 3)
        >>> try:
        ...     layer.kernel.value
        ... except lm.UnboundVariableError:
        ...     print("no value outside a call")
        no value outside a call
    """


class TraceContextError(RuntimeError):
    """A key was drawn or a variable written inside a raw JAX transform begun inside a call.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Noisy(lm.Module):
        ...     def __call__(self, x):  # jax.vmap inside: every member would get one key
        ...         return jax.vmap(lambda row: row + jax.random.normal(lm.next_rng_key()))(x)
        >>> init, apply = lm.transform(Noisy())
        >>> try:
        ...     apply({}, jax.random.key(0), jnp.ones((2, 3)))
        ... except lm.TraceContextError:
        ...     print("refused: use lm.vmap with lm.split_rngs")
        refused: use lm.vmap with lm.split_rngs
    """


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type where a number or a flag is needed (a float size, a string rate).

    Also a `ValueError`, the error a wrong setting raises, so that code catching either one
    catches it.
    """
