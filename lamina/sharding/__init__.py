"""Sharding: where each variable lives on a mesh, read from the plan."""

from .shardings import shardings as shardings
