"""Reading a model directory's weights one tensor at a time, by memory map.

GPS fills its host window from a checkpoint tensor by tensor: each `reader(name)` maps the
tensor's bytes out of its safetensors file (`safe_open`: the file is memory-mapped, only
that tensor's pages are touched) and the caller copies them where they belong before it
asks for the next. No whole file is loaded into a dict, so a host rank's extra memory is
one tensor, not the model. safetensors holds no code: nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivot_hpc.models.description import ModelDescription, description_of
from pivot_hpc.models.safetensors_headers import ModelDirError


class TensorReader:
    """name -> that tensor (a torch tensor, the file's dtype and shape) of one directory.

    Lazy: nothing is opened before the first call (ranks that never read pay nothing).
    Use it as a context manager, or call `close()`, to release the file maps early.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        self._desc: ModelDescription | None = None
        self._open: dict[str, Any] = {}

    @property
    def description(self) -> ModelDescription:
        if self._desc is None:
            self._desc = description_of(self.path)
        return self._desc

    def __call__(self, name: str):
        desc = self.description
        if name not in desc:
            raise ModelDirError(
                f"{self.path}: its safetensors hold no tensor {name!r}, which the model being "
                "loaded has; load it from the directory it was described from"
            )
        file = desc.tensor(name).file
        handle = self._open.get(file)
        if handle is None:
            from safetensors import safe_open

            handle = self._open[file] = safe_open(str(self.path / file), framework="pt")
        return handle.get_tensor(name)

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap their file when released

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
