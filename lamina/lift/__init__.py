"""Lifted transforms: JAX transforms that take modules (vmap, scan, cond, loops, checkpoint)."""

from .lift import Carry as Carry
from .lift import StateAxes as StateAxes
from .lift import checkpoint as checkpoint
from .lift import cond as cond
from .lift import fori_loop as fori_loop
from .lift import remat as remat
from .lift import scan as scan
from .lift import split_rngs as split_rngs
from .lift import switch as switch
from .lift import vmap as vmap
from .lift import while_loop as while_loop
