"""Lifted transforms: JAX transforms that take modules (vmap, scan, cond, loops, checkpoint)."""

from .axes import Carry as Carry
from .axes import StateAxes as StateAxes
from .axes import split_rngs as split_rngs
from .checkpoint import checkpoint as checkpoint
from .checkpoint import remat as remat
from .control import cond as cond
from .control import fori_loop as fori_loop
from .control import switch as switch
from .control import while_loop as while_loop
from .iteration import scan as scan
from .iteration import vmap as vmap
