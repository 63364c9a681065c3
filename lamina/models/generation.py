"""`generate`: autoregressive decoding with a static KV cache, the loop compiled once.

One `jax.jit` holds the prefill and a `jax.lax.while_loop` over the new tokens, on a cache
sized ``prompt length + max_new_tokens`` (`CausalLM.with_cache`). The prefill computes the
logits of the prompt's last position alone (``logits_to_keep=1``, as transformers), and the
program leaves out the layers' run-time overflow checks (`without_run_time_checks`): no step can
pass the end of a cache of that size. The decoding copy of a model and its compiled programs
are kept with the model object (weakly: they go when it goes), per static shapes (batch,
prompt length, ``max_new_tokens``, ``top_k``, greedy or sampling, top-p on or off; up to 8
stop ids share one shape), so a repeated call costs the checks of its arguments and one
dispatch: another temperature, top-p, stop id, key or set of weights reuses the program. The
last 16 programs of each model are kept, and the decoding copies that they use.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.checks import is_int, is_real, without_run_time_checks
from .._core.module import Module
from .._core.transform import transform
from .llama import CausalLM, init_cache
from .sampling import sample

_KEEP = 16


class _Kept:
    """What `generate` keeps for one model object: its decoding copies and programs."""

    def __init__(self, model: CausalLM):
        self.fingerprint = _fingerprint(model)
        self.decoders: dict[tuple[int, int], CausalLM] = {}
        # (static shapes and options) -> the compiled loop, newest last.
        self.programs: collections.OrderedDict[tuple, Callable[..., Any]] = (
            collections.OrderedDict()
        )


# id(model) -> (a weak reference to it, what is kept for it); the entry goes with the model.
_KEPT: dict[int, tuple[weakref.ref, _Kept]] = {}


def generate(
    model: CausalLM,
    variables: Mapping[str, Any],
    prompt_ids: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Sequence[int] | None = None,
    rng: Any = None,
    mask: Any = None,
) -> jax.Array:
    """Continues each prompt by up to `max_new_tokens` tokens, as transformers' ``generate``.

    Greedy (``temperature=0``, the default) takes the most likely token at each step and
    gives transformers' ``generate(do_sample=False)`` tokens. With ``temperature > 0`` it
    samples: the float32 logits of the last position are divided by `temperature`, then
    restricted to the `top_k` most likely tokens (ties kept), then to the smallest set whose
    probability reaches `top_p` (transformers' order), and a token is drawn with the key
    ``jax.random.fold_in(rng, step)`` (folded again with the row index), so no key is reused
    and a row's tokens depend only on its index and `rng`, not on the other rows (the same
    prompt at another index draws other tokens).

    A row that emits one of `eos_id` (by default the model config's ``eos_token_id``, as
    transformers) is finished: its later tokens are the padding id, the config's
    ``pad_token_id`` or, when it has none, the first stop id (as transformers writes
    ``pad_token_id``, falling back to eos), and decoding stops once every row is finished.
    The prefill and the loop compile once per model object, batch size, prompt length,
    `max_new_tokens`, `top_k` and mode, and are kept with the model (with its decoding copy,
    `CausalLM.with_cache`); another `temperature`, `top_p`, `eos_id`, `rng` or set of
    weights reuses them. A model changed in place gets a new copy. `generate` compiles
    itself: call it outside `jax.jit`, `jax.vmap` or `jax.grad`, with concrete arrays.

    Args:
        model: A `lamina.models.CausalLM` (with or without a cache: `generate` makes its own,
            of ``prompt length + max_new_tokens`` positions), as built or changed since
            (LoRA-wrapped by `lm.replace`, `lm.freeze`, `lm.with_policy`).
        variables: Its variables (``{"params": ...}``, from `from_pretrained` or `init`).
        prompt_ids: Integer token ids: one prompt ``(length,)``, a batch ``(batch, length)``
            (all tokens real, or padded on the left as `mask` says), or a list of 1-D
            prompts of different lengths, left padded here (as transformers'
            ``padding_side="left"``) with the padding id (see above).
        max_new_tokens: The most tokens to add (>= 1).
        temperature: 0 for greedy decoding, else the sampling temperature (> 0): a Python
            or NumPy number or a 0-d concrete array.
        top_k: Keep only the `top_k` most likely tokens (sampling only; None or 0: all).
        top_p: Keep the most likely tokens up to probability `top_p` (sampling only; None or
            1.0: all).
        eos_id: The stop token id, or several (Llama 3 has two); None (the default): the
            model config's ``eos_token_id`` (``config.json``'s), as transformers; ``()``:
            never stop early.
        rng: A `jax.random.key` (needed to sample).
        mask: Bool, `prompt_ids`' shape: True at real tokens, False at padding, which must
            be on the left (transformers' ``attention_mask`` of a tokenizer with
            ``padding_side="left"``, as ``mask.astype(bool)``). Padding ids are kept in the
            result as given and never read. None: every token is real.

    Returns:
        int32 ids ``(batch, padded prompt length + new tokens)``: the (left-padded) prompts,
        then the tokens generated, fewer than `max_new_tokens` when every row stopped; a
        1-D prompt gives a 1-D result.

    Raises:
        TypeError: `model` is not a `CausalLM`; ids that are not integers; a `rng` that is
            not a key; an option of the wrong type; variables without ``"params"``; a
            call under `jax.jit` or `jax.vmap` (traced arguments).
        ValueError: An empty prompt, an id outside the vocabulary, a temperature that is
            not finite, `top_k`/`top_p` with greedy decoding, sampling without `rng`, a
            `mask` of another shape, with a row of padding only or padding on the right, or
            a prompt plus `max_new_tokens` longer than the model's
            ``max_position_embeddings``.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.models import CausalLM, ModelConfig
        >>> config = ModelConfig("llama", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
        >>> model = CausalLM(config)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> lm.generate(model, variables, jnp.array([3, 1, 4]), max_new_tokens=4).shape
        (7,)
        >>> out = lm.generate(model, variables, [[3, 1, 4], [5]], max_new_tokens=2,
        ...                   temperature=0.8, top_k=5, rng=jax.random.key(1))
        >>> out.shape  # left padded to 3, then 2 new tokens
        (2, 5)
    """
    where = "lm.generate"
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"{where} takes a lamina.models.CausalLM (from lamina.models.from_pretrained or "
            f"CausalLM(config)), got {type(model).__name__}."
        )
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{where}: variables must be the model's variables dict, {{'params': ...}} (as "
            f"from_pretrained or init returns), got {type(variables).__name__}."
        )
    if "params" not in variables:
        keys = [str(k) for k in list(variables)[:8]]
        raise TypeError(
            f"{where}: variables must be the model's variables dict, {{'params': ...}} (as "
            f"from_pretrained or init returns); got a {type(variables).__name__} without "
            f"'params', with keys {keys}{' ...' if len(variables) > 8 else ''}. If these are "
            f"the parameters (variables['params']), pass {{'params': variables}}."
        )
    _not_traced(where, variables, prompt_ids, mask, temperature, top_p, eos_id, rng)
    config = model.config
    steps = _positive_int(where, "max_new_tokens", max_new_tokens)
    eos = _eos_ids(where, eos_id, config)
    greedy, temperature, top_k, top_p = _options(where, temperature, top_k, top_p, rng)
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0] if eos else 0
    ids, mask, one_prompt = _prompts(where, prompt_ids, mask, pad, config.vocab_size)
    longest = int(mask.sum(axis=-1).max())
    if longest + steps > config.max_position_embeddings:
        raise ValueError(
            f"{where}: a prompt of {longest} tokens plus max_new_tokens={steps} reaches "
            f"position {longest + steps - 1}, past the model's max_position_embeddings="
            f"{config.max_position_embeddings} (config.json): it was not trained there. "
            f"Ask for fewer tokens; to decode further anyway, build the model with "
            f"dataclasses.replace(model.config, max_position_embeddings=...)."
        )
    # The stop ids as a (multiple of 8,) array, repeated (or -1, never a token, for none):
    # other stop ids reuse the compiled program.
    stops = np.full(-(-max(len(eos), 1) // 8) * 8, eos[0] if eos else -1, np.int32)
    stops[: len(eos)] = eos
    batch, length = ids.shape
    kept = _kept(model)
    static = (batch, length, steps, top_k, greedy, top_p is None, len(stops))
    run = kept.programs.pop(static, None)
    if run is None:
        shape = (batch, length + steps)
        decoder = kept.decoders.get(shape)
        if decoder is None:
            decoder = kept.decoders[shape] = model.with_cache(*shape)
        run = _compile(decoder, length, steps, top_k, greedy, top_p is None)
    kept.programs[static] = run
    if len(kept.programs) > _KEEP:
        while len(kept.programs) > _KEEP:
            kept.programs.popitem(last=False)
        # A decoding copy goes with the last kept program of its shape.
        used = {(b, t + n) for b, t, n, *_ in kept.programs}
        for unused in [shape for shape in kept.decoders if shape not in used]:
            del kept.decoders[unused]
    params = {name: tree for name, tree in variables.items() if name != "cache"}
    options = (np.float32(temperature), np.float32(1.0 if top_p is None else top_p))
    out, count = run(params, ids, mask, *options, None if greedy else rng, stops, np.int32(pad))
    # Sliced here, once per number of steps run (a cached slice), only when some stopped.
    end = length + int(count)
    if end < out.shape[1]:
        out = out[:, :end]
    return out[0] if one_prompt else out


def _kept(model: CausalLM) -> _Kept:
    """What is kept for `model`; made anew when the model was changed in place since."""
    entry = _KEPT.get(id(model))
    if entry is not None and entry[0]() is model and _same(entry[1].fingerprint, model):
        return entry[1]
    kept = _Kept(model)
    key = id(model)
    _KEPT[key] = (weakref.ref(model, lambda _: _KEPT.pop(key, None)), kept)
    return kept


def _fingerprint(model: Module) -> list[Any]:
    """Every value the model's modules hold (submodules, settings, declarations), in order.

    A declaration is compared as one object (`lm.with_policy` and the like change copies).
    The values are held, so that an object replaced in place cannot be mistaken for a new
    one that took its id.
    """
    found: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Module):
            values: Any = vars(node).values()
        elif isinstance(node, dict):
            values = node.values()
        elif isinstance(node, (list, tuple)):
            values = node
        else:
            continue
        for value in values:
            found.append(value)
            if isinstance(value, (Module, list, tuple, dict)):
                stack.append(value)
    return found


def _same(fingerprint: list[Any], model: Module) -> bool:
    now = _fingerprint(model)
    return len(now) == len(fingerprint) and all(
        a is b for a, b in zip(now, fingerprint, strict=True)
    )


def _compile(
    decoder: CausalLM, length: int, steps: int, top_k: int | None, greedy: bool, no_top_p: bool
) -> Callable[..., Any]:
    """The jitted prefill + loop for one decoder build and one set of static options."""
    apply = transform(decoder).apply

    def choose(logits: jax.Array, step: jax.Array, options: tuple) -> jax.Array:
        temperature, top_p, rng = options
        if greedy:  # no key is drawn from: a constant one, made at trace time
            return sample(logits, jax.random.key(0), temperature=0.0)
        key = jax.random.fold_in(rng, step)  # sample folds the row in: one key per token
        top_p = None if no_top_p else top_p
        return sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)

    def run(
        params: Any,
        ids: jax.Array,
        mask: jax.Array,
        temperature: jax.Array,
        top_p: jax.Array,
        rng: jax.Array | None,
        eos: jax.Array,
        pad: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        options = (temperature, top_p, rng)

        def stops(token: jax.Array) -> jax.Array:
            return jnp.any(token[:, None] == eos[None, :], axis=-1)

        real = jnp.where(mask, ids, 0)  # padding ids are kept in `out`, never read
        # The cache holds length + steps positions and the loop runs steps - 1 times after
        # the prefill: no step can overflow it, so the layers' run-time checks are left out.
        # The prefill computes the logits of the last position alone (the output layer is
        # most of a long prompt's work).
        with without_run_time_checks():
            logits, state = apply(
                {**params, **init_cache(decoder)},
                None,
                real,
                mask=mask,
                decode=True,
                logits_to_keep=1,
            )
        first = choose(logits[:, -1], jnp.zeros((), jnp.int32), options)
        out = jnp.zeros((ids.shape[0], length + steps), jnp.int32)
        out = lax.dynamic_update_slice(out, ids.astype(jnp.int32), (0, 0))
        out = lax.dynamic_update_slice(out, first[:, None], (0, length))

        def more(carry: tuple) -> jax.Array:
            step, _, _, finished, _ = carry
            return (step < steps) & ~jnp.all(finished)

        def body(carry: tuple) -> tuple:
            step, cache, token, finished, out = carry
            with without_run_time_checks():
                logits, state = apply({**params, "cache": cache}, None, token[:, None], decode=True)
            token = choose(logits[:, 0], step, options)
            token = jnp.where(finished, pad, token)
            out = lax.dynamic_update_slice(
                out, token[:, None], (jnp.zeros_like(step), length + step)
            )
            return step + 1, state["cache"], token, finished | stops(token), out

        start = (jnp.ones((), jnp.int32), state["cache"], first, stops(first), out)
        count, _, _, _, out = lax.while_loop(more, body, start)
        return out, count

    return jax.jit(run)


def _positive_int(where: str, name: str, value: Any) -> int:
    if not is_int(value):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{where}: {name} must be at least 1, got {value}.")
    return int(value)


def _not_traced(where: str, *values: Any) -> None:
    """Raises if any of `values` (or a leaf of one) is a tracer: `generate` under jit/vmap."""
    for value in values:
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value)):
            raise TypeError(
                f"{where} compiles itself; call it outside jax.jit/vmap (or grad, scan...): it "
                f"got a traced value ({type(value).__name__}), and it needs concrete prompts, "
                f"options and variables to check them and choose its compiled program."
            )


def _eos_ids(where: str, eos_id: Any, config: Any) -> tuple[int, ...]:
    """The stop ids as a tuple (None: the config's; empty: none), each checked to be a token."""
    vocab_size = config.vocab_size
    if eos_id is None:
        wrong = [i for i in config.eos_token_id if not 0 <= i < vocab_size]
        if wrong:
            raise ValueError(
                f"{where}: the model config's eos_token_id {wrong[0]} (the default stop id) "
                f"is not a token id of this model (vocab_size={vocab_size}); pass eos_id= "
                f"(or eos_id=() to never stop early)."
            )
        return tuple(config.eos_token_id)
    ids = (eos_id,) if is_int(eos_id) else eos_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray):
        raise TypeError(
            f"{where}: eos_id must be an int, a sequence of ints or None, got "
            f"{type(eos_id).__name__} {eos_id!r}."
        )
    ids = tuple(ids)
    if not all(is_int(i) for i in ids):
        raise TypeError(
            f"{where}: eos_id must be an int, a sequence of ints (empty: never stop) or None "
            f"(the config's), got {eos_id!r}."
        )
    wrong = [int(i) for i in ids if not 0 <= i < vocab_size]
    if wrong:
        raise ValueError(
            f"{where}: eos_id {wrong[0]} is not a token id of this model (vocab_size={vocab_size})."
        )
    return tuple(int(i) for i in ids)


def _options(
    where: str, temperature: Any, top_k: Any, top_p: Any, rng: Any
) -> tuple[bool, float, int | None, float | None]:
    """Checks the sampling options: (greedy, temperature, top_k or None, top_p or None)."""
    temperature, top_p = _scalar(temperature), _scalar(top_p)
    if not is_real(temperature) or isinstance(temperature, bool):
        raise TypeError(f"{where}: temperature must be a number, got {temperature!r}.")
    if not math.isfinite(temperature):
        raise ValueError(
            f"{where}: temperature must be a finite number, got {temperature}: 0 decodes "
            f"greedily, a temperature > 0 samples (a large one is close to uniform sampling)."
        )
    if not temperature >= 0.0:
        raise ValueError(
            f"{where}: temperature must be 0 (greedy) or positive (sampling), got {temperature}."
        )
    if top_k is not None and (not is_int(top_k) or isinstance(top_k, bool)):
        raise TypeError(f"{where}: top_k must be an int or None, got {top_k!r}.")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{where}: top_k must be None, 0 (off) or positive, got {top_k}.")
    if top_p is not None and (not is_real(top_p) or isinstance(top_p, bool)):
        raise TypeError(f"{where}: top_p must be a number or None, got {top_p!r}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"{where}: top_p must be in (0, 1], got {top_p}.")
    top_k = None if not top_k else int(top_k)
    top_p = None if top_p is None or top_p == 1.0 else float(top_p)
    greedy = temperature == 0.0
    if greedy and (top_k is not None or top_p is not None):
        raise ValueError(
            f"{where}: top_k={top_k} and top_p={top_p} act only when sampling, and "
            f"temperature=0 decodes greedily: they would be ignored. Pass temperature > 0 "
            f"(and rng) to sample, or drop them."
        )
    if not greedy:
        if rng is None:
            raise ValueError(
                f"{where}: temperature={temperature} samples, which needs a key: pass "
                f"rng=jax.random.key(seed)."
            )
        _check_key(where, rng)
    return greedy, float(temperature), top_k, top_p


def _scalar(value: Any) -> Any:
    """A 0-d (concrete) array of numbers as a Python float; anything else as it is."""
    dtype = getattr(value, "dtype", None)
    if (
        isinstance(value, (jax.Array, np.ndarray, np.generic))
        and np.shape(value) == ()
        and dtype is not None
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    ):
        return float(value)
    return value


def _check_key(where: str, rng: Any) -> None:
    dtype = getattr(rng, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and tuple(np.shape(rng)) == (2,)
    if not (typed and np.shape(rng) == ()) and not raw:
        raise TypeError(
            f"{where}: rng must be one key, jax.random.key(seed), got "
            f"{type(rng).__name__} of shape {np.shape(rng)} and dtype {dtype}."
        )


def _prompts(
    where: str, prompt_ids: Any, mask: Any, pad: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(ids (B, T) int32, mask (B, T) bool, one prompt?)``: ragged prompts left padded."""
    ragged = isinstance(prompt_ids, (list, tuple)) and any(np.ndim(p) == 1 for p in prompt_ids)
    if ragged and mask is not None:
        try:
            prompt_ids = np.asarray(prompt_ids)  # rows of one length: a padded batch
        except ValueError:
            raise ValueError(
                f"{where}: a list of prompts of different lengths is padded here, so it "
                f"takes no mask: give the prompts as they are (unpadded), or an array "
                f"(batch, length) with its mask."
            ) from None
    elif ragged:
        rows = [np.asarray(p) for p in prompt_ids]
        if any(row.ndim != 1 for row in rows):
            raise ValueError(
                f"{where}: a list of prompts must hold 1-D id sequences, got shapes "
                f"{[row.shape for row in rows]}."
            )
        if not rows or any(row.size == 0 for row in rows):
            raise ValueError(_EMPTY.format(where=where))
        for row in rows:
            _check_ids(where, row, vocab_size)
        length = max(row.size for row in rows)
        ids = np.full((len(rows), length), pad, np.int32)
        valid = np.zeros((len(rows), length), bool)
        for i, row in enumerate(rows):
            ids[i, length - row.size :] = row
            valid[i, length - row.size :] = True
        return ids, valid, False
    array = np.asarray(prompt_ids)
    if array.ndim not in (1, 2):
        raise ValueError(
            f"{where}: prompt_ids must be (length,), (batch, length) or a list of 1-D "
            f"prompts, got shape {array.shape}."
        )
    if array.size == 0:
        raise ValueError(_EMPTY.format(where=where))
    one = array.ndim == 1
    given = _mask(where, mask, array.shape)
    _check_ids(where, array if given is None else array[given], vocab_size)
    ids = array.reshape(1, -1) if one else array
    real = np.ones(ids.shape, bool) if given is None else given.reshape(ids.shape)
    return ids.astype(np.int32, copy=False), real, one


_EMPTY = "{where}: every prompt needs at least one token (a BOS token for an empty text)."


def _check_ids(where: str, ids: np.ndarray, vocab_size: int) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(
            f"{where}: prompt ids must be integers, got dtype {ids.dtype}; convert with "
            f"ids.astype(int)."
        )
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{where}: prompt id {low if low < 0 else high} is not a token id of this model "
            f"(vocab_size={vocab_size})."
        )


def _mask(where: str, mask: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """`mask` checked: bool, the prompt's shape, left padding, a real token in each row."""
    if mask is None:
        return None
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise TypeError(
            f"{where}: mask must be bool (True at real tokens), got dtype {array.dtype}; a "
            f"0/1 attention mask (a tokenizer's) is mask.astype(bool)."
        )
    if array.shape != shape:
        raise ValueError(f"{where}: mask must have prompt_ids' shape {shape}, got {array.shape}.")
    rows = array.reshape(-1, shape[-1])
    empty = np.flatnonzero(~rows.any(axis=-1))
    if empty.size:
        raise ValueError(
            f"{where}: mask row {int(empty[0])} has no real token (all False); every prompt "
            f"needs at least one (a BOS token for an empty text)."
        )
    right = np.flatnonzero((rows[:, :-1] & ~rows[:, 1:]).any(axis=-1))
    if right.size:
        raise ValueError(
            f"{where}: mask row {int(right[0])} has padding after a real token; generate "
            f"continues each row after its last position, so padding must be on the left "
            f"(a tokenizer's padding_side='left'), or give the prompts as a list, unpadded."
        )
    return array
