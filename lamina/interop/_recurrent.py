"""The built-in converters of the recurrent layers: `RNN` and `Bidirectional` <- nn.LSTM/nn.GRU.

PyTorch stacks the gates' weights in one matrix per source, ``weight_ih_l0`` ``(gates *
hidden, in)`` and ``weight_hh_l0`` ``(gates * hidden, hidden)``, in the order ``i, f, g, o``
(LSTM) or ``r, z, n`` (GRU), with a bias per source. lamina's cells hold one `Dense` per gate
and source, as Linen's: ``i<gate>`` from the input and ``h<gate>`` from the hidden state.

- LSTM: lamina has one bias per gate (on ``h<gate>``), so ``bias_ih + bias_hh`` goes there.
- GRU: the input transforms carry the biases of ``r`` and ``z`` (``bias_ih + bias_hh``) and
  of ``n`` (``bias_ih`` alone); ``hn`` carries ``bias_hh`` of ``n``, which ``r`` gates.

Back to PyTorch, the summed biases go to ``bias_hh`` and ``bias_ih`` gets zeros there.
A backward direction (`Bidirectional`'s ``backward_rnn``) reads the ``_reverse`` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..nn.bidirectional import Bidirectional
from ..nn.gru_cells import GRUCell
from ..nn.lstm_cells import LSTMCell
from ..nn.recurrent import RNN
from ._registry import Unsupported, below, prefixed, register_torch, take

Arrays = Mapping[str, Any]

_GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("r", "z", "n")}


def _kind(rnn: Any, where: str) -> str:
    cell = getattr(rnn, "cell", None) if isinstance(rnn, RNN) else None
    if isinstance(cell, LSTMCell):  # OptimizedLSTMCell included: the same variables
        return "LSTM"
    if isinstance(cell, GRUCell):
        return "GRU"
    what = f"an RNN of {type(cell).__name__}" if isinstance(rnn, RNN) else type(rnn).__name__
    raise Unsupported(
        f"{where} is {what}; PyTorch's recurrent layers convert to lm.RNN(lm.LSTMCell(...)) "
        f"(nn.LSTM) and lm.RNN(lm.GRUCell(...)) (nn.GRU)"
    )


def rnn_to_lamina(rnn: Any, t: Arrays, suffix: str = "", where: str = "it") -> dict[str, Any]:
    """One direction of one layer: ``*_l0<suffix>`` into ``cell/<source><gate>/...``."""
    kind = _kind(rnn, where)
    gates, cell = _GATES[kind], rnn.cell
    n, size, hidden = len(gates), cell.in_size, cell.hidden_size
    order = ", ".join(gates)
    w_ih = take(
        t, f"weight_ih_l0{suffix}", (n * hidden, size), f"({n} * hidden_size, input_size), {order}"
    )
    w_hh = take(
        t, f"weight_hh_l0{suffix}", (n * hidden, hidden), f"({n} * hidden_size, hidden_size)"
    )
    b_ih = take(t, f"bias_ih_l0{suffix}", (n * hidden,), f"({n} * hidden_size,)")
    b_hh = take(t, f"bias_hh_l0{suffix}", (n * hidden,), f"({n} * hidden_size,)")
    out: dict[str, Any] = {}
    for k, gate in enumerate(gates):
        rows = slice(k * hidden, (k + 1) * hidden)
        out[f"cell/i{gate}/kernel"] = w_ih[rows].T
        out[f"cell/h{gate}/kernel"] = w_hh[rows].T
        if kind == "LSTM":
            out[f"cell/h{gate}/bias"] = b_ih[rows] + b_hh[rows]
        elif gate == "n":
            out["cell/in/bias"] = b_ih[rows]
            out["cell/hn/bias"] = b_hh[rows]
        else:
            out[f"cell/i{gate}/bias"] = b_ih[rows] + b_hh[rows]
    return out


def rnn_to_torch(rnn: Any, v: Arrays, suffix: str = "", where: str = "it") -> dict[str, Any]:
    """The inverse of `rnn_to_lamina`; summed biases in ``bias_hh``, zeros in ``bias_ih``."""
    kind = _kind(rnn, where)
    gates = _GATES[kind]
    w_ih = np.concatenate([v[f"cell/i{g}/kernel"].T for g in gates])
    w_hh = np.concatenate([v[f"cell/h{g}/kernel"].T for g in gates])
    if kind == "LSTM":
        b_hh = np.concatenate([v[f"cell/h{g}/bias"] for g in gates])
        b_ih = np.zeros_like(b_hh)
    else:
        r, z, n_in, n_hn = (
            v[k] for k in ("cell/ir/bias", "cell/iz/bias", "cell/in/bias", "cell/hn/bias")
        )
        b_ih = np.concatenate([np.zeros_like(r), np.zeros_like(z), n_in])
        b_hh = np.concatenate([r, z, n_hn])
    names = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
    return {f"{name}{suffix}": a for name, a in zip(names, (w_ih, w_hh, b_ih, b_hh), strict=True)}


def bidirectional_to_lamina(layer: Bidirectional, t: Arrays) -> dict[str, Any]:
    """``forward_rnn`` from the ``*_l0`` names, ``backward_rnn`` from ``*_l0_reverse``."""
    forward = rnn_to_lamina(layer.forward_rnn, t, "", "its forward_rnn")
    backward = rnn_to_lamina(layer.backward_rnn, t, "_reverse", "its backward_rnn")
    return {**prefixed("forward_rnn/", forward), **prefixed("backward_rnn/", backward)}


def bidirectional_to_torch(layer: Bidirectional, v: Arrays) -> dict[str, Any]:
    """The inverse of `bidirectional_to_lamina`."""
    forward = rnn_to_torch(layer.forward_rnn, below("forward_rnn/", v), "", "its forward_rnn")
    backward = below("backward_rnn/", v)
    return {**forward, **rnn_to_torch(layer.backward_rnn, backward, "_reverse", "its backward_rnn")}


def register() -> None:
    """Registers the converters of this file."""
    register_torch(RNN, rnn_to_lamina, rnn_to_torch)
    register_torch(Bidirectional, bidirectional_to_lamina, bidirectional_to_torch)
