"""Records: values a module reports while it runs (sow, perturb, capture_intermediates, probe)."""

from .records import Probe as Probe
from .records import capture_intermediates as capture_intermediates
from .records import perturb as perturb
from .records import probe as probe
from .records import sow as sow
