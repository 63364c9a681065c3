"""Layers, one family per file."""

from .linear import Dense as Dense
