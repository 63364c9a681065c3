"""Sharding: where each variable lives on a device mesh, and what shards the layers' results.

A room beside the core that reads the `Plan`: each declaration's logical axis names, mapped
onto mesh axes by rules (`shardings`, one `NamedSharding` per variable, for
``jax.jit(init, out_shardings=...)``). `explicit.py` holds the helpers the layers and the
lifted transforms use on a mesh with explicit axes (`result_sharding`, `match_sharding`,
`gather_axis`, `unshard_leading`); `collectives.py` averages a whole pytree across devices
in one collective per dtype (`pmean`). It imports only the core.
"""

from .collectives import pmean as pmean
from .shardings import shardings as shardings
