"""Data for examples and tests: MNIST-format folders, the bundled digits, a batch iterator."""

from .batches import batches as batches
from .idx import IdxFormatError as IdxFormatError
from .idx import read_idx as read_idx
from .images import FASHION_MNIST_DIR as FASHION_MNIST_DIR
from .images import ImageData as ImageData
from .images import load_default_images as load_default_images
from .images import load_digits as load_digits
from .images import load_idx_folder as load_idx_folder
