"""Records: values a module reports while it runs (sow, perturb, capture_intermediates, probe)."""

from .capture import Probe as Probe
from .capture import capture_intermediates as capture_intermediates
from .capture import probe as probe
from .sow import perturb as perturb
from .sow import sow as sow
