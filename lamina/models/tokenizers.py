"""`load_tokenizer`: a folder's ``tokenizer.json`` through the ``tokenizers`` package."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer of a Hugging Face folder, or None when it has none.

    Reads ``tokenizer.json`` (the "fast" tokenizer every recent checkpoint ships) with the
    ``tokenizers`` package, which is not a dependency of lamina: install it with
    ``pip install tokenizers``. Weights-only folders (no ``tokenizer.json``) give None.

    Args:
        path: The folder (or the ``tokenizer.json`` file itself).

    Returns:
        A ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``), or None.

    Raises:
        ImportError: If the folder has a ``tokenizer.json`` but ``tokenizers`` is not
            installed.
        ValueError: If the file is not a tokenizer ``tokenizers`` can read.

    Example:
        >>> import json, os, tempfile
        >>> from lamina.models import load_tokenizer
        >>> folder = tempfile.TemporaryDirectory()
        >>> load_tokenizer(folder.name) is None
        True
        >>> spec = {"version": "1.0", "model": {"type": "WordLevel", "unk_token": "?",
        ...         "vocab": {"?": 0, "hello": 1, "world": 2}},
        ...         "pre_tokenizer": {"type": "Whitespace"}}
        >>> with open(os.path.join(folder.name, "tokenizer.json"), "w") as f:
        ...     json.dump(spec, f)
        >>> load_tokenizer(folder.name).encode("hello world").ids
        [1, 2]
        >>> folder.cleanup()
    """
    file = os.fspath(path)
    if os.path.isdir(file):
        file = os.path.join(file, "tokenizer.json")
    elif not os.path.exists(file):
        raise FileNotFoundError(f"load_tokenizer: {file} is neither a folder nor a file")
    if not os.path.isfile(file):
        return None
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            f"load_tokenizer: {file} needs the tokenizers package, which is not installed: "
            f"pip install tokenizers"
        ) from error
    try:
        return tokenizers.Tokenizer.from_file(file)
    except Exception as error:  # the package raises a bare Exception for bad files
        raise ValueError(
            f"load_tokenizer: {file} is not a tokenizer the tokenizers package reads ({error})"
        ) from error
