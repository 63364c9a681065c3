"""Data for examples and tests: MNIST-format folders, the bundled digits, a batch iterator.

Beside the model rather than below it: it reads files and NumPy arrays, no plan and no
module, and imports nothing of lamina. `idx.py` reads the IDX format, `images.py` the
image-classification folders and scikit-learn's digits, `batches.py` shuffles and batches.
"""

from .batches import batches as batches
from .idx import IdxFormatError as IdxFormatError
from .idx import read_idx as read_idx
from .images import FASHION_MNIST_DIR as FASHION_MNIST_DIR
from .images import ImageData as ImageData
from .images import load_default_images as load_default_images
from .images import load_digits as load_digits
from .images import load_idx_folder as load_idx_folder
