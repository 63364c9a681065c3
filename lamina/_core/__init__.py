"""The core: definition (modules, variables) -> plan (one walk) -> call (frames)."""
