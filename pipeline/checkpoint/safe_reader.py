"""DCP's metadata file read without arbitrary unpickling: only DCP's own metadata classes, torch's
sizes, dtypes and storages, and plain containers are admitted."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint._extension", "torch.distributed.checkpoint.planner",
                    "torch.distributed.checkpoint.storage", "torch.distributed._shard.metadata",
                    "torch.distributed._shard.sharded_tensor.metadata", "torch.distributed._shard.sharding_spec")
_ALLOWED_BUILTINS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                                               "bytes", "bool", "slice", "NoneType", "getattr")}
_ALLOWED_TORCH = {("torch", "Size"), ("torch", "device"), ("torch", "memory_format"), ("torch", "layout"),
                  ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                  ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}



class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_BUILTINS | _ALLOWED_TORCH or module.startswith(_ALLOWED_MODULES) \
                or (module == "torch" and name.endswith("Storage")) or (module == "torch" and name in dir(torch)
                                                                           and isinstance(getattr(torch, name), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata unpickling admits only DCP metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
