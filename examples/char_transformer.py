"""A character-level transformer language model: nanoGPT's Shakespeare benchmark in lamina.

A decoder-only transformer (GPT) reads a text one character at a time and learns to predict
the next one: token and learned position embeddings, an `lm.Stack` of pre-norm blocks
(LayerNorm, causal `MultiHeadAttention`, residual; LayerNorm, a 4x MLP with GELU, residual;
dropout; the Stack splits the random streams per layer, so each layer draws its own masks),
a final LayerNorm and an output layer tied to the token embedding (`--no-tie`: a separate
one). Tied by default because nanoGPT ties them, and its 1.88 is the figure to compare with;
with Shakespeare's 65 characters an untied layer adds only 1% more weights. AdamW with a
linear warmup and a cosine decay (nanoGPT's settings), gradients clipped to norm 1. The
first 90% of the text trains, the last 10% validates. At the end it writes a few hundred
characters, decoding incrementally with the attention layers' `Cache`.

Each batch is split across the devices (data parallelism: `--devices`). On a CPU, XLA runs a
small model's operations one after another, on about one core; so the example makes each of
the CPU's cores a JAX device (``jax_num_cpu_devices``) and gives each a share of the batch.
The numbers are those of one device (the gradient of the mean loss is the mean of the
shares' gradients, up to float rounding; with dropout, each device draws its own masks); the
step takes about two thirds of the time on 2 cores. Each device computes its share's
gradients in `jax.shard_map`, and `lm.pmean` averages them in one collective. With
``--devices 1``, or on one GPU, it is a plain single-device program. One call runs up to 25
steps (a scan over batches drawn at once: the host's work per step is then nearly nothing).
XLA's compiled programs are kept between runs (``--compile-cache``, in ``~/.cache/lamina/xla``):
a second run with the same settings reads them back instead of compiling (all but the
sampler's).

The defaults are nanoGPT's CPU settings for Shakespeare (4 layers, 4 heads, width 128,
context 64, batch 12, 2,000 iterations, no dropout, learning rate 1e-3), whose published
validation loss is 1.88:

    python examples/char_transformer.py --data ../shared/data/tinyshakespeare.txt
    python examples/char_transformer.py                  # no --data: Python's own source
    python examples/char_transformer.py --iters 200 --eval-interval 50   # a quick run
    python examples/char_transformer.py --precision bfloat16   # mixed precision (lm.with_policy)

Without --data it trains on text that ships with every Python: the standard library's
top-level modules (``<stdlib>/*.py``), in alphabetical order, up to about 1 MB; it says which.
It saves the metrics (metrics.json) and the loss curves (curves.png) in
runs/char_transformer-<date>-<time>/, or in the folder --out names. The last line it prints
is ``val loss: X.XXXX``, the mean loss over fixed validation windows, without dropout.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import functools
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import lamina as lm

STDLIB_CHARACTERS = 1_000_000  # about the size of tinyshakespeare.txt


# Compile requests and hits of JAX's persistent compilation cache, counted from its events.
COMPILE_CACHE = collections.Counter()


def default_compile_cache() -> str:
    """Where a run as a script keeps XLA's compiled programs: JAX's own setting if the user
    made one (``JAX_COMPILATION_CACHE_DIR``), else ``lamina/xla`` in the user's cache folder
    (``$XDG_CACHE_HOME``, by default ``~/.cache``), which only they can write: the entries
    are native code that the next run loads."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lamina", "xla")


def use_compile_cache(folder: str | None) -> None:
    """Keeps XLA's compiled programs in `folder` between runs (JAX's persistent compilation
    cache), so a run with the same settings, JAX version and machine reads its programs back
    instead of compiling them: the setup, the evaluation and the training step, about 4.5 s
    of CPU time on 2 cores (the sampler, which calls back to the host, is compiled every
    time: JAX keeps no such program). Each program is kept, however quick its compilation.
    The folder is created for this user alone; nothing prunes it. A damaged entry (a run
    killed while writing) is compiled again at every run, with JAX's warning: delete the
    folder. The setting is the process's, so only a run as a script makes it by default;
    None or an empty string keeps nothing."""
    if not folder:
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if not COMPILE_CACHE:
        COMPILE_CACHE["listening"] = 1
        jax.monitoring.register_event_listener(
            lambda event, **_: COMPILE_CACHE.update(
                [event.rsplit("/", 1)[-1]] if event.startswith("/jax/compilation_cache/") else []
            )
        )


def keep_freed_memory() -> bool:
    """Asks glibc's malloc to keep the memory each thread frees for its next allocations,
    instead of handing it back to the kernel and taking page faults to get it again.

    XLA:CPU's worker threads allocate from glibc's per-thread arenas, whose heaps (64 MiB
    each) glibc deletes as soon as everything in one is freed. After the first evaluation in
    the middle of training (a bigger program, with bigger buffers), each training step could
    take a heap of its own and free it again: on 2 cores, 4.5 to 7.8 million page faults in
    600 iterations (160 ``mprotect`` calls a step), 50 ms per iteration instead of 37. Three
    settings keep the heaps: a top pad of 64 MiB (a heap never goes away), no trimming below
    1 GiB, and buffers up to 32 MiB (glibc's maximum) from the heaps rather than ``mmap``.
    The same as running with ``MALLOC_TOP_PAD_=67108864 MALLOC_TRIM_THRESHOLD_=1073741824
    MALLOC_MMAP_THRESHOLD_=33554432``; the process keeps 0.1 to 0.2 GB more (its peak
    resident memory: 0.98 to 1.06 GB, against 0.89 GB without). One arena for all threads
    (``M_ARENA_MAX=1``, which earlier versions set) would also stop the faults, but
    serialises the devices' allocations. Linux with glibc
    only; elsewhere it does nothing and returns False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # no glibc
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's <malloc.h>
    settings = ((m_top_pad, 64 << 20), (m_trim_threshold, 1 << 30), (m_mmap_threshold, 32 << 20))
    return [mallopt(option, value) for option, value in settings] == [1, 1, 1]


def cpu_cores_as_devices(count: int | None = None) -> bool:
    """Makes each of the CPU's cores (or `count`) a JAX device, so that a batch can be split
    across them. JAX reads the setting when it starts its CPU backend, so this must run
    before the first JAX computation; afterwards (say, in a test that imported JAX already)
    it changes nothing and returns False.
    """
    if count is None:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        count = count or os.cpu_count() or 1
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backends are running already
        return False
    return True


class DeviceCountError(ValueError):
    """--devices asks for more devices than JAX has, or for a count that splits the batch
    unevenly."""


def batch_devices(requested: int | None, batch_size: int) -> list:
    """The devices to split each batch across: `requested` of them, or by default the most
    (of the default backend's) that divide `batch_size` evenly."""
    available = jax.devices()
    if requested is not None:
        if batch_size % requested:
            raise DeviceCountError(
                f"--devices {requested} does not divide --batch-size {batch_size}: each device "
                f"takes an equal share of the batch"
            )
        if requested > len(available):
            raise DeviceCountError(
                f"--devices {requested}: JAX has {len(available)} "
                f"{available[0].platform.upper()} device(s) (on a CPU, one per core)"
            )
        return available[:requested]
    count = max(n for n in range(1, len(available) + 1) if batch_size % n == 0)
    return available[:count]


# --- the model --------------------------------------------------------------------------


class Block(lm.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    `decode_shape` gives the attention layer a `Cache` for incremental decoding.
    """

    def __init__(self, width, heads, dropout, layers, decode_shape=None):
        super().__init__()
        # GPT-2's initialisation (nanoGPT's): normal(0.02), and the two projections into the
        # residual stream scaled down by sqrt(2 * layers), one for each residual addition.
        weights = lm.initializers.normal(0.02)
        residual = lm.initializers.normal(0.02 / math.sqrt(2 * layers))
        # Logical axis names (for examples/sharded_training.py; on one device they do
        # nothing): Megatron's layout splits attention by heads and the MLP by hidden units.
        norm = {"scale_sharding": ("embed",), "bias_sharding": ("embed",)}
        self.attention_norm = lm.LayerNorm(width, epsilon=1e-5, **norm)
        self.attention = lm.MultiHeadAttention(
            heads,
            width,
            dropout_rate=dropout,
            broadcast_dropout=False,
            kernel_init=weights,
            out_kernel_init=residual,
            decode_shape=decode_shape,
            kernel_sharding=("embed", "heads", "kv"),
            bias_sharding=("heads", "kv"),
            out_kernel_sharding=("heads", "kv", "embed"),
            out_bias_sharding=("embed",),
        )
        self.mlp_norm = lm.LayerNorm(width, epsilon=1e-5, **norm)
        self.mlp_in = lm.Dense(
            width,
            4 * width,
            kernel_init=weights,
            kernel_sharding=("embed", "mlp"),
            bias_sharding=("mlp",),
        )
        self.mlp_out = lm.Dense(
            4 * width,
            width,
            kernel_init=residual,
            kernel_sharding=("mlp", "embed"),
            bias_sharding=("embed",),
        )
        self.dropout = lm.Dropout(dropout)

    def __call__(self, x, is_training=False, decode=False):
        h = self.attention(
            self.attention_norm(x), causal=True, is_training=is_training, decode=decode
        )
        x = x + self.dropout(h, is_training)
        h = self.mlp_out(lm.gelu(self.mlp_in(self.mlp_norm(x))))
        return x + self.dropout(h, is_training)


class CharTransformer(lm.Module):
    """A decoder-only transformer over `vocab_size` characters, `block_size` of context.

    ``model(ids)`` maps ``(batch, length)`` ids to ``(batch, length, vocab_size)`` logits of
    the next character. With `decode_batch`, the attention layers hold a cache for
    ``decode_batch`` sequences of up to `block_size` characters, and ``model(ids, decode=True,
    start=n)`` reads the characters at positions ``n, n + 1, ...`` given the cached ones.
    """

    def __init__(
        self,
        vocab_size,
        *,
        layers=4,
        heads=4,
        width=128,
        block_size=64,
        dropout=0.0,
        tie=True,
        decode_batch=None,
        unroll=True,
    ):
        super().__init__()
        weights = lm.initializers.normal(0.02)
        self.token = lm.Embed(
            vocab_size, width, embedding_init=weights, embedding_sharding=("vocab", "embed")
        )
        self.position = lm.Embed(
            block_size, width, embedding_init=weights, embedding_sharding=(None, "embed")
        )
        self.dropout = lm.Dropout(dropout)
        decode_shape = None if decode_batch is None else (decode_batch, block_size)
        # `unroll`: blocks per step of the Stack's scan. All of them (straight-line code) is
        # the fastest for a few blocks on a CPU, where a loop costs copies; 1 keeps the
        # program the size of one block, whatever the depth.
        block = Block(width, heads, dropout, layers, decode_shape)
        self.blocks = lm.Stack(block, layers, unroll=unroll)
        self.norm = lm.LayerNorm(
            width, epsilon=1e-5, scale_sharding=("embed",), bias_sharding=("embed",)
        )
        # Tied: the output layer is the token embedding read backwards (`Embed.attend`).
        self.head = None
        if not tie:
            self.head = lm.Dense(
                width,
                vocab_size,
                kernel_init=weights,
                kernel_sharding=("embed", "vocab"),
                bias_sharding=("vocab",),
            )

    def __call__(self, ids, is_training=False, *, decode=False, start=0):
        positions = start + jnp.arange(ids.shape[-1], dtype=jnp.int32)
        x = self.token(ids) + self.position(positions)[None]  # ids: (batch, length)
        x = self.dropout(x, is_training)
        x = self.blocks(x, is_training=is_training, decode=decode)
        x = self.norm(x)
        return self.token.attend(x) if self.head is None else self.head(x)


def build_model(args, vocab_size, decode_batch=None) -> CharTransformer:
    model = CharTransformer(
        vocab_size,
        layers=args.layers,
        heads=args.heads,
        width=args.width,
        block_size=args.block_size,
        dropout=args.dropout,
        tie=args.tie,
        decode_batch=decode_batch,
        unroll=True if args.unroll is None else args.unroll,
    )
    if args.precision == "bfloat16":
        # Mixed precision: the blocks compute in bfloat16 from float32 parameters, except
        # their LayerNorms (float32 statistics, bfloat16 out); the embeddings, the final
        # norm and the tied output layer stay float32, so the logits and the loss are too.
        model = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=lm.Stack)
        model = lm.with_policy(
            model,
            lm.Policy("float32", "float32", "bfloat16"),
            where=lm.All(lm.LayerNorm, lm.PathContains("blocks")),
        )
    return model


# --- data -------------------------------------------------------------------------------


@dataclass
class Text:
    """A text as character ids: the vocabulary, the training part and the validation part."""

    name: str
    chars: str  # the vocabulary, sorted: id i is chars[i]
    train: np.ndarray  # int32 ids, the first 90%
    val: np.ndarray  # the last 10%

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class TextTooShortError(ValueError):
    """The text has no room for one validation window."""


def stdlib_text(limit: int = STDLIB_CHARACTERS) -> tuple[str, str]:
    """Python's own source: the standard library's top-level ``*.py`` files, sorted by name,
    whole files until `limit` characters are reached. Returns ``(name, text)``."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    parts, size, files = [], 0, []
    for path in sorted(folder.glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        parts.append(source)
        files.append(path.name)
        size += len(source)
        if size >= limit:
            break
    if not parts:
        raise FileNotFoundError(f"no *.py files in the standard library folder {folder}")
    name = (
        f"Python {sysconfig.get_python_version()}'s standard library, {len(files)} files "
        f"{files[0]} to {files[-1]} from {folder}"
    )
    return name, "".join(parts)


def load_text(args) -> Text:
    """The text --data names (or the standard library's source); prints what it is."""
    if args.data:
        path = Path(args.data)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {path.resolve()} (--data)")
        text = path.read_text(encoding="utf-8")
        name = path.name
        print(f"data: {path.resolve()}")
    else:
        name, text = stdlib_text()
        print(f"data: {name} (no --data given)")
    chars = "".join(sorted(set(text)))
    split = int(0.9 * len(text))
    if len(text) - split <= args.block_size + 1:  # the smaller part: validation
        raise TextTooShortError(
            f"{name}: {len(text):,} characters leave {len(text) - split:,} for validation, too "
            f"few for one window of --block-size {args.block_size} plus the next character; "
            f"use a longer text or a smaller --block-size."
        )
    data = Text(name, chars, np.empty(0, np.int32), np.empty(0, np.int32))
    ids = data.encode(text)
    data.train, data.val = ids[:split], ids[split:]
    print(
        f"{len(text):,} characters, {len(chars)} distinct: {len(data.train):,} to train on, "
        f"{len(data.val):,} to validate"
    )
    return data


def windows(ids, starts, block_size):
    """``(inputs, targets)``: for each start (an array of any shape), `block_size` ids and the
    same shifted by one."""
    chunk = ids[starts[..., None] + np.arange(block_size + 1)]
    return chunk[..., :-1], chunk[..., 1:]


# --- training ---------------------------------------------------------------------------


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(args, model, params):
    """nanoGPT's AdamW: warmup, cosine decay to lr / 10, betas (0.9, 0.99), weight decay 0.1
    on the matrices (kernels and embeddings) only, gradients clipped to global norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=min(args.warmup_iters, args.iters),
        decay_steps=max(args.iters, args.warmup_iters + 1),
        end_value=args.lr / 10,
    )
    matrices = lm.Any(lm.PathContains("kernel"), lm.PathContains("embedding"))
    decay = lm.mask(model, {"params": params}, matrices)["params"]
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.1, mask=decay),
    )
    return optimizer, schedule


def make_steps(apply, optimizer, split=None, steps_per_call=1):
    """The jitted training step and evaluation.

    `split` (a sharding along one mesh axis) spreads each batch across devices along its
    first axis: each device computes the loss and gradients of its own rows
    (`jax.shard_map`), and `lm.pmean` averages them in one all-reduce of one buffer (the
    jitted step with a sharded batch alone has XLA average them, one buffer per weight:
    XLA:CPU meets the other device once per buffer, 2 to 3 ms more per step here). Each
    device draws its own dropout masks. The weights and AdamW stay replicated. On one device
    it is the plain step.

    With `steps_per_call` above 1, one call runs that many steps (a `lax.scan` over batches
    stacked in front, ``Batches.next(steps_per_call)``) and returns their losses: the host
    draws batches and dispatches once per call (see `STEPS_PER_CALL`).
    """

    def loss_and_grads(params, inputs, targets, key, step):
        def loss_fn(params):
            dropout_key = jax.random.fold_in(key, step)
            logits, _ = apply({"params": params}, {"dropout": dropout_key}, inputs, True)
            return cross_entropy(logits, targets)

        return jax.value_and_grad(loss_fn)(params)

    if split is not None and split.mesh.size > 1:
        (axis,) = split.spec[:1]
        whole = loss_and_grads

        def per_device(params, inputs, targets, key, step):
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
            mine = jax.lax.pcast(params, axis, to="varying")  # each device's own gradient
            return lm.pmean(whole(mine, inputs, targets, key, step), axis)

        rows = P(axis)
        loss_and_grads = jax.shard_map(
            per_device, mesh=split.mesh, in_specs=(P(), rows, rows, P(), P()), out_specs=P()
        )

    def one_step(params, opt_state, inputs, targets, key, step):
        loss, grads = loss_and_grads(params, inputs, targets, key, step)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def several_steps(params, opt_state, inputs, targets, key, first):
        def turn(carry, batch):
            params, opt_state, step = carry
            params, opt_state, loss = one_step(params, opt_state, *batch, key, step)
            return (params, opt_state, step + 1), loss

        carry = (params, opt_state, jnp.asarray(first, jnp.int32))
        (params, opt_state, _), losses = jax.lax.scan(turn, carry, (inputs, targets))
        return params, opt_state, losses

    train_step = jax.jit(one_step if steps_per_call == 1 else several_steps, donate_argnums=(0, 1))

    @jax.jit
    def evaluate(params, inputs, targets):
        logits, _ = apply({"params": params}, None, inputs, False)
        return cross_entropy(logits, targets)

    return train_step, evaluate


# Steps per call of the training program. The host draws each batch and dispatches each call
# on the same 2 cores the devices compute on (numpy's windows, the transfer, JAX's dispatch
# of 60-odd arrays); in calls of 25 steps that work is spread over 25. The count divides
# --iters, --eval-interval and --log-interval (their greatest common divisor with this),
# so evaluations and progress updates fall between calls; 1 is one step per call.
STEPS_PER_CALL = 25


def steps_per_call(args) -> int:
    return math.gcd(args.iters, args.eval_interval, args.log_interval, STEPS_PER_CALL)


class CompileAhead:
    """`step` (a jitted function) traced for `args` here, and compiled by XLA on a thread of
    its own; calling this runs it, waiting for the compilation at the first call.

    `args` are arrays or `jax.ShapeDtypeStruct`s (shape, dtype and sharding), so the
    compilation can start before the arrays exist. Tracing stays on the calling thread, under
    its JAX settings (``jax.numpy_dtype_promotion`` and the like are per thread); XLA's
    compiler releases Python's lock, so the caller goes on meanwhile: the example compiles
    its training step (about 3 s on 2 cores) while it initialises the weights and compiles
    and runs the first evaluation. A call with other shapes, dtypes or shardings than `args`
    is an error, as for any `jax.stages.Compiled`; so is an error of the compilation, raised
    at the first call.
    """

    def __init__(self, step, *args):
        lowered = step.lower(*args)

        def compile_timed():
            tick = time.perf_counter()
            return lowered.compile(), time.perf_counter() - tick

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
        self._compiling = pool.submit(compile_timed)
        pool.shutdown(wait=False)  # the thread ends with the compilation

    def __call__(self, *args):
        return self._compiling.result()[0](*args)

    @property
    def seconds(self) -> float:
        """How long XLA took to compile (waiting for it to finish)."""
        return self._compiling.result()[1]


class Batches:
    """Random training windows, drawn on the host (as nanoGPT's ``get_batch`` does) while the
    devices run the previous steps, and sent split across them.

    ``next()`` returns ``(inputs, targets)``, each ``(batch_size, block_size)``;
    ``next(count)`` returns `count` batches at once, each ``(count, batch_size, block_size)``:
    the windows of `count` calls to ``next()``. The same seed gives the same batches.
    """

    def __init__(self, ids: np.ndarray, args, seed: int, split=None):
        self.ids, self.block_size, self.batch_size = ids, args.block_size, args.batch_size
        self.rng = np.random.default_rng(seed)
        self.split = split

    def next(self, count=None):
        last_start = len(self.ids) - self.block_size - 1
        shape = (self.batch_size,) if count is None else (count, self.batch_size)
        starts = self.rng.integers(0, last_start + 1, shape)
        return jax.device_put(
            windows(self.ids, starts, self.block_size), stacked(self.split, count)
        )


def stacked(split, count):
    """`split` (a batch's sharding) for `count` batches stacked in front; `split` itself for
    one batch (None)."""
    if split is None or count is None:
        return split
    return NamedSharding(split.mesh, P(None, *split.spec))


def validation_windows(data: Text, args, split=None):
    """The fixed validation windows: `eval_batches` batches' worth, evenly spaced."""
    count = args.eval_batches * args.batch_size
    starts = np.linspace(0, len(data.val) - args.block_size - 1, count).astype(np.int64)
    return jax.device_put(windows(data.val, starts, args.block_size), split)


def train(args, data: Text) -> dict:
    """Trains on `data`, evaluating every --eval-interval iterations, then samples."""
    model = build_model(args, len(data.chars))
    if not args.quiet:
        print(lm.summary(model))
    init, apply = lm.transform(model)
    shapes = jax.eval_shape(lambda: init(jax.random.key(0))["params"])
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    print(
        f"model: {args.layers} layers, {args.heads} heads, width {args.width}, context "
        f"{args.block_size}, {'tied' if args.tie else 'untied'} output layer, "
        f"{num_params:,} parameters"
        + ("; the blocks compute in bfloat16" if args.precision == "bfloat16" else "")
    )
    optimizer, _ = make_optimizer(args, model, shapes)
    devices = batch_devices(args.devices, args.batch_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    print(
        f"devices: {len(devices)} {devices[0].platform.upper()}, "
        f"{args.batch_size // len(devices)} windows of the batch each"
    )

    # One program for the keys, the weights and Adam's moments, run once: XLA's optimisations
    # would take longer to compile it (seconds, for threefry's many rounds) than they save.
    @functools.partial(
        jax.jit,
        out_shardings=replicated,
        compiler_options={"xla_backend_optimization_level": 0},
    )
    def setup(seed):
        init_key, train_key, sample_key = jax.random.split(jax.random.key(seed), 3)
        params = init(init_key)["params"]
        return params, optimizer.init(params), train_key, sample_key

    per_call = steps_per_call(args)
    train_step, evaluate = make_steps(apply, optimizer, split, per_call)
    count = None if per_call == 1 else per_call
    window = jax.ShapeDtypeStruct(
        (*([] if count is None else [count]), args.batch_size, args.block_size),
        jnp.int32,
        sharding=stacked(split, count),
    )
    params_shape, opt_shape, key_shape, _ = jax.tree.map(  # all replicated, as setup gives
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        jax.eval_shape(setup, args.seed),
    )
    train_step = CompileAhead(train_step, params_shape, opt_shape, window, window, key_shape, 0)
    params, opt_state, train_key, sample_key = setup(args.seed)
    batches = Batches(data.train, args, args.seed, split)
    validation = validation_windows(data, args, split)

    state = (params, opt_state)
    run = fit(args, state, train_step, evaluate, batches, validation, train_key, per_call)
    params, history, losses = run["params"], run["history"], run["losses"]
    loop_seconds, eval_seconds = run["seconds"], run["eval_seconds"]
    first_step_seconds = run["first_step_seconds"]
    steady_seconds = loop_seconds - eval_seconds - first_step_seconds
    ms_per_iter = 1000 * steady_seconds / max(args.iters - per_call, 1)

    tick = time.perf_counter()
    params, sample_key = jax.device_put((params, sample_key), devices[0])  # one is enough
    text = sample(args, data, params, sample_key, args.sample_chars, args.temperature)
    sample_seconds = time.perf_counter() - tick
    train_curve = per_step(losses)
    return {
        "data": data.name,
        "vocab_size": len(data.chars),
        "train_characters": len(data.train),
        "val_characters": len(data.val),
        "parameters": num_params,
        "history": history,
        "train_loss_per_iter": train_curve,
        "val_loss": history[-1]["val_loss"],
        "seconds": {
            "loop": loop_seconds,
            "compiling_the_step_beside_the_rest": train_step.seconds,
            "first_step_with_compilation": first_step_seconds,
            "training_steps_after_the_first": steady_seconds,
            "evaluation_with_compilation": eval_seconds,
            "sampling_with_compilation": sample_seconds,
        },
        "ms_per_iter": ms_per_iter,
        "steps_per_call": per_call,
        "devices": len(devices),
        "sample": text,
    }


# Steps queued ahead of the devices, in whole calls (at least one call: 25 steps when a call
# runs 25). JAX runs ahead of them (asynchronous dispatch) while the host draws the next
# batches; but with several CPU devices, each call's all-reduces need every device's share
# running at once, and XLA:CPU's client (jaxlib 0.10) deadlocks when more than about 32
# such calls wait in its queues (its worker threads block on a full device queue while the
# share they wait for sits behind it). Eight keep the devices busy: waiting for the step
# eight back costs nothing, it finished long ago.
IN_FLIGHT = 8


def per_step(losses) -> np.ndarray:
    """The losses `fit` returns (a scalar or a vector of them per call), one per step."""
    return np.concatenate([np.atleast_1d(x) for x in jax.device_get(losses)])


def fit(args, state, train_step, evaluate, batches, validation, key, per_call=1) -> dict:
    """The training loop: --iters steps from ``state = (params, opt_state)``, `per_call` steps
    per call of `train_step` (a divisor of --iters, --eval-interval and --log-interval),
    evaluating on the `validation` windows every --eval-interval iterations, with a progress
    bar.

    Returns the final params, the evaluations (`history`), the losses of every call (device
    arrays: one per step, or `per_call` of them) and the seconds spent: in all, in
    evaluation, and in the first call (compiling).
    """
    params, opt_state = state
    eval_steps = sorted({*range(0, args.iters, args.eval_interval), args.iters})
    count = None if per_call == 1 else per_call
    in_flight = max(IN_FLIGHT // per_call, 1)  # calls queued, whatever --log-interval says

    def mean_of_last(steps):
        return float(np.mean(per_step(losses[-(steps // per_call) :])))

    history, losses = [], []
    eval_seconds = first_step_seconds = 0.0
    bar = tqdm(total=args.iters, unit="it", disable=args.quiet, leave=False, mininterval=0.5)
    start = time.perf_counter()
    for step in range(0, args.iters + 1, per_call):
        if step in eval_steps:
            jax.block_until_ready(params)  # the steps before it count as training time
            tick = time.perf_counter()
            val_loss = float(evaluate(params, *validation))
            eval_seconds += time.perf_counter() - tick
            train_loss = mean_of_last(args.eval_interval) if losses else None
            history.append({"step": step, "train_loss": train_loss, "val_loss": val_loss})
            shown = "-" if train_loss is None else f"{train_loss:.4f}"
            message = f"step {step:5d}  train loss {shown}  val loss {val_loss:.4f}"
            (print if args.quiet else tqdm.write)(message)
        if step == args.iters:
            break
        tick = time.perf_counter()
        inputs, targets = batches.next(count)
        params, opt_state, loss = train_step(params, opt_state, inputs, targets, key, step)
        losses.append(loss)
        if len(losses) > in_flight:
            losses[-1 - in_flight].block_until_ready()
        if step == 0:  # the call that compiles (or waits for its compilation)
            jax.block_until_ready(loss)
            first_step_seconds = time.perf_counter() - tick
        done = step + per_call
        if done % args.log_interval == 0 or done == args.iters:
            bar.set_postfix(loss=f"{mean_of_last(args.log_interval):.4f}")  # a wait per update
            bar.update(done - bar.n)
    bar.close()
    return {
        "params": params,
        "history": history,
        "losses": losses,
        "seconds": time.perf_counter() - start,
        "eval_seconds": eval_seconds,
        "first_step_seconds": first_step_seconds,
    }


# --- sampling ---------------------------------------------------------------------------


def sample(args, data, params, key, num_chars, temperature, *, use_cache=True, prompt=None):
    """Writes `num_chars` characters after `prompt` (default: a newline, as nanoGPT starts).

    With the cache (incremental decoding), each step reads only the new character: the
    attention layers append its keys and values to their `Cache` and attend to the cached
    ones. The context is at most `block_size` characters (the learned positions end there):
    when it is full, it moves on to its last half, and the cache starts again from those
    characters. All of it is one compiled program (`_sampler`: a `lax.while_loop`, no trip
    to the host per character), compiled once per call. ``use_cache=False`` is the
    reference: a Python loop running the whole context through the model for every
    character. Both pick with ``jax.random.categorical(jax.random.fold_in(key, i), logits /
    temperature)`` for the `i`-th character (``argmax`` at ``temperature=0``), so with the
    same `key` they write the same characters, up to rounding in near ties.
    """
    if prompt is None:
        prompt = "\n" if "\n" in data.chars else data.chars[0]
    block_size = args.block_size
    keep = max(block_size // 2, 1)  # the context kept when the window moves on
    tokens = [int(i) for i in data.encode(prompt)][-block_size:]
    if not tokens:
        raise ValueError("sample: the prompt is empty; give at least one character to start from")
    if num_chars == 0:
        return ""

    def pick(key, logits, i):
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)

    if use_cache:
        write = _sampler(args, len(data.chars), len(tokens), num_chars, pick)
        return data.decode(jax.device_get(write(params, key, np.asarray(tokens, np.int32))))

    apply = lm.transform(build_model(args, len(data.chars))).apply

    @jax.jit
    def next_token(params, key, ids, length, i):
        """Reads the whole context (padded, so one program serves all lengths)."""
        logits, _ = apply({"params": params}, None, ids)
        return pick(key, logits[0, length - 1], i)

    window = 0  # the context is tokens[window:]
    for i in range(num_chars):
        context = tokens[window:]
        ids = jnp.asarray([context + [0] * (block_size - len(context))], dtype=jnp.int32)
        tokens.append(int(next_token(params, key, ids, len(context), i)))
        if len(tokens) - window > block_size:  # full: move on to its last `keep` characters
            window = len(tokens) - keep
    return data.decode(tokens[-num_chars:])


def _sampler(args, vocab_size, prompt_length, num_chars, pick):
    """One compiled program writing `num_chars` characters after a prompt of `prompt_length`.

    A `lax.while_loop` reads one character per turn into the cache: ``text[read]``, at
    position ``read - window`` of the context ``text[window:length]`` (``length``: the
    characters so far). The turn that has read them all picks the next character. When the
    context is full, it moves on to its last `keep` characters: the cache starts again,
    empty, and the next turns read those back. So the program holds the model once, as a
    one-character step (not also a prompt read and a `keep`-character restart), with its
    blocks as a loop (``unroll=1``): for a few hundred characters compiling takes most of
    the time, and this halves it at the cost of some more steps (about 500 characters in
    1.1 s, not 1.5 s, on 2 cores). The attention layers' run-time check of the cache index
    stays in: the restart rule keeps every step inside the cache, and leaving the check out
    (as `lm.generate` does) saved no measurable time.
    """
    args = argparse.Namespace(**{**vars(args), "unroll": 1})  # the same parameters
    init, apply = lm.transform(build_model(args, vocab_size, decode_batch=1))
    shapes = jax.eval_shape(lambda: init(jax.random.key(0))["cache"])
    block_size, keep = args.block_size, max(args.block_size // 2, 1)
    total = prompt_length + num_chars

    def turn(params, key, state):
        text, length, read, window, cache = state
        full = length - window > block_size  # move on, and restart the cache
        window = jnp.where(full, length - keep, window)
        read = jnp.where(full, window, read)
        cache = jax.tree.map(lambda c: jnp.where(full, jnp.zeros_like(c), c), cache)
        ids = jax.lax.dynamic_slice(text, (read,), (1,))[None]
        variables = {"params": params, "cache": cache}
        logits, new = apply(variables, None, ids, decode=True, start=read - window)
        read = read + 1
        done = read == length  # all read: write the next character
        token = pick(key, logits[0, -1], length - prompt_length)
        text = text.at[length].set(jnp.where(done, token, text[length]))
        return text, length + done.astype(jnp.int32), read, window, new["cache"]

    # Optimisation level 1: compiles faster than the default (3) and runs as fast here.
    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 1})
    def write(params, key, prompt):
        text = jnp.zeros(total, jnp.int32).at[:prompt_length].set(prompt)
        empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # index 0
        start = (text, jnp.int32(prompt_length), jnp.int32(0), jnp.int32(0), empty)
        state = jax.lax.while_loop(
            lambda state: state[1] < total, lambda state: turn(params, key, state), start
        )
        return state[0][prompt_length:]

    return write


# --- the command line -------------------------------------------------------------------


def save(results: dict, args) -> dict:
    history = results["history"]
    losses = results["train_loss_per_iter"]
    steps = np.arange(1, len(losses) + 1)
    evals = [row["step"] for row in history]
    panels = {
        "loss": {
            "train (each iteration)": (steps, losses),
            "validation": (evals, [row["val_loss"] for row in history]),
        }
    }
    folder = _common.run_folder(args, "char_transformer")
    return _common.save_run(folder, results, args, panels, "iteration")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="a UTF-8 text file; the first 90%% trains, the last 10%% validates (default: the "
        "standard library's source, about 1 MB of it)",
    )
    add = parser.add_argument
    add("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add("--width", type=int, default=128, help="embedding size (default: %(default)s)")
    add("--block-size", type=int, default=64, help="context, in characters (default: %(default)s)")
    add("--batch-size", type=int, default=12, help="(default: %(default)s)")
    add("--iters", type=int, default=2000, help="training iterations (default: %(default)s)")
    add("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    add(
        "--warmup-iters",
        type=int,
        default=100,
        help="linear warmup, then cosine decay to lr / 10 (default: %(default)s)",
    )
    add("--dropout", type=float, default=0.0, help="(default: %(default)s)")
    add(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="output layer tied to the token embedding (default: tied, as nanoGPT)",
    )
    add(
        "--eval-interval",
        type=int,
        default=250,
        help="iterations between evaluations (default: %(default)s)",
    )
    add(
        "--eval-batches",
        type=int,
        default=20,
        help="validation batches, the same windows every time (default: %(default)s)",
    )
    add(
        "--log-interval",
        type=int,
        default=25,
        help="iterations between progress-bar updates (default: %(default)s)",
    )
    add("--sample-chars", type=int, default=500, help="characters to write at the end")
    add(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    add("--seed", type=int, default=1337, help="(default: %(default)s, nanoGPT's)")
    add(
        "--devices",
        type=int,
        help="devices to split each batch across (default: as many as divide --batch-size; "
        "on a CPU each core is a device)",
    )
    add(
        "--unroll",
        type=int,
        help="blocks per step of the Stack's scan (default: all, straight-line code; 1 keeps "
        "the program the size of one block)",
    )
    _common.add_output_argument(parser, "char_transformer")
    add(
        "--compile-cache",
        metavar="DIR",
        help="keep XLA's compiled programs in DIR, so the next run with the same settings "
        "reads them back (default as a script: $JAX_COMPILATION_CACHE_DIR if set, else "
        "~/.cache/lamina/xla; '' keeps none)",
    )
    add(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the blocks' compute dtype; parameters stay float32 (default: %(default)s)",
    )
    add("--quiet", action="store_true", help="no progress bar or model summary")
    args = parser.parse_args(argv)
    for name in ("layers", "heads", "width", "block_size", "batch_size", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("eval_interval", "eval_batches", "log_interval", "devices", "unroll"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    if not 0.0 <= args.dropout < 1.0:
        parser.error("--dropout must be in [0, 1)")
    if args.sample_chars < 0 or args.temperature < 0:
        parser.error("--sample-chars and --temperature must not be negative")
    return args


def main(argv=None, compile_cache=None) -> dict:
    """Runs the example; `compile_cache` is --compile-cache's default (the script's:
    `default_compile_cache`; from Python: none, since the setting is the process's)."""
    args = parse_args(argv)
    cpu_cores_as_devices()
    keep_freed_memory()
    use_compile_cache(compile_cache if args.compile_cache is None else args.compile_cache)
    cache_before = COMPILE_CACHE.copy()
    try:
        data = load_text(args)
    except (OSError, UnicodeDecodeError, TextTooShortError) as error:
        raise SystemExit(f"error: {error}") from None
    try:
        results = train(args, data)
    except DeviceCountError as error:
        raise SystemExit(f"error: {error}") from None
    seconds, per_call = results["seconds"], results["steps_per_call"]
    print(f"\nsample ({args.sample_chars} characters, temperature {args.temperature}):")
    print(results["sample"])
    print(
        f"\n{args.iters} iterations in {seconds['loop']:.1f} s: "
        f"{results['ms_per_iter']:.1f} ms per iteration after the first call "
        f"({per_call} step{'s' * (per_call > 1)} a call; the first waited "
        f"{seconds['first_step_with_compilation']:.1f} s for its compilation: "
        f"{seconds['compiling_the_step_beside_the_rest']:.1f} s, beside the setup and the first "
        f"evaluation), {seconds['evaluation_with_compilation']:.1f} s evaluating; "
        f"sampling {seconds['sampling_with_compilation']:.1f} s"
    )
    cache = COMPILE_CACHE - cache_before  # this run's
    if cache["compile_requests_use_cache"]:
        print(
            f"compiled programs: {cache['cache_hits']} of {cache['compile_requests_use_cache']}"
            f" read from XLA's cache in {jax.config.jax_compilation_cache_dir} (--compile-cache)"
        )
    results["files"] = save(results, args)
    print(f"val loss: {results['val_loss']:.4f}")
    return results


if __name__ == "__main__":
    main(compile_cache=default_compile_cache())
