"""A Lightning callback for :mod:`tests.meta_init_run`: after a few training steps every tensor the project's own
objects hold is on the CPU (none on ``meta``, where Lightning's init context put what was made without a device),
and every table's rows at the start were the drawn ones (:func:`modules.embedding.row_init.normal_rows_numpy`, the
numpy reference)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import lightning as L
import numpy as np
import torch

from modules.embedding.row_init import RowInit, normal_rows_numpy
from modules.embedding.sharded_kernels import kernels


OURS = ("modules.", "pipeline.", "tests.")


def _ours(obj: object) -> bool:
    return type(obj).__module__.startswith(OURS)


def held_tensors(roots: dict[str, object], max_depth: int = 80) -> dict[str, torch.Tensor]:
    """Every tensor the project's own objects hold, by a path from ``roots``: through their attributes, containers,
    closures of the hooks they put on any module (TorchRec's too), and bound methods; not the parameters and buffers
    of modules (TorchRec's sharding and Lightning place those) nor the inside of other libraries' objects."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[path] = obj
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)):
                walk(v, f"{path}[{i}]", depth + 1)
        elif inspect.ismethod(obj):
            walk(obj.__self__, f"{path}.__self__", depth + 1)
        elif inspect.isfunction(obj):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    walk(cell.cell_contents, f"{path}<{name}>", depth + 1)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(obj, torch.nn.Module):
            for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
                walk(getattr(obj, kind, {}), f"{path}.{kind}", depth + 1)
            for name, child in obj._modules.items():
                walk(child, f"{path}.{name}", depth + 1)
            if _ours(obj):
                for name, value in vars(obj).items():
                    if not name.startswith(("_modules", "_parameters", "_buffers", "_forward", "_backward",
                                            "_state_dict", "_load_state_dict", "_non_persistent")):
                        walk(value, f"{path}.{name}", depth + 1)
        elif _ours(obj) and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                walk(value, f"{path}.{name}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found


def drawn_rows_differ(model: torch.nn.Module, rows: int = 64) -> list[str]:
    """The tables (of a TorchRec-sharded model) whose first ``rows`` local rows are not their ``RowInit``'s draws."""
    wrong = []
    for module in model.modules():
        for config in getattr(module, "_embedding_bag_configs", []) + getattr(module, "_embedding_configs", []):
            init = config.init_fn
            if not isinstance(init, RowInit):
                continue
            for name, weight in module.state_dict().items():
                if name.split(".")[-2] != config.name or not hasattr(weight, "local_shards"):
                    continue
                for shard in weight.local_shards():
                    r0, c0 = (int(o) for o in shard.metadata.shard_offsets)
                    n = min(rows, shard.tensor.shape[0])
                    cols = shard.tensor.shape[1]
                    want = np.concatenate([normal_rows_numpy(init.seed, key, np.arange(max(lo, r0), min(hi, r0 + n),
                                                                                       dtype=np.uint64) - np.uint64(lo),
                                                             config.embedding_dim, init.std)
                                           for lo, hi, key in init.segments if lo < r0 + n and hi > r0]
                                          )[:, c0:c0 + cols] if init.std else np.zeros((n, cols), np.float32)
                    if not np.array_equal(shard.tensor[:n].detach().cpu().numpy(), want):
                        wrong.append(f"{config.name}[{r0}:{r0 + n}, {c0}:]")
    return wrong


class HostStructures(L.Callback):
    """Writes ``<out>`` (JSON): the meta tensors found after ``after_steps`` steps and the tables whose rows were not
    the drawn ones before the first step."""

    def __init__(self, out: str, after_steps: int = 2) -> None:
        self.out, self.after_steps, self.rows_differ = Path(out), after_steps, None

    def on_train_start(self, trainer: L.Trainer, task: L.LightningModule) -> None:
        self.rows_differ = drawn_rows_differ(task.model)

    def on_train_batch_end(self, trainer: L.Trainer, task: L.LightningModule, *args: object) -> None:
        if trainer.global_step == self.after_steps:
            held = held_tensors({"task": task, "callbacks": [c for c in trainer.callbacks if c is not self],
                                 "kernels": [k for _, _, k in kernels(task.model)]})  # (not all reached by modules())
            self.out.write_text(json.dumps({
                "held": sorted(held), "not_on_cpu": {path: str(t.device) for path, t in held.items() if t.device.type != "cpu"},
                "rows_differ": self.rows_differ, "module_device": str(task.device)}))


class DeviceMoves(L.Callback):
    """Writes ``<out>`` (JSON) when testing starts: every call that moved the LightningModule (``cpu``, ``cuda``, ``to``)
    or its optimizers' state between ``fit`` and ``test``, and how often the strategy's ``model_to_device`` ran.
    On a CPU a move to the CPU changes nothing, so the calls themselves are what is checked: on a GPU the model's
    shards and state would leave the device (Lightning's ``Strategy.teardown`` moves them when ``fit`` ends)."""

    def __init__(self, out: str) -> None:
        self.out, self.moves, self.model_to_device = Path(out), [], 0

    def setup(self, trainer: L.Trainer, task: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for name in ("cpu", "cuda", "to"):
            original = getattr(task, name)

            def spy(*args, _name=name, _original=original, **kwargs):
                self.moves.append(f"{_name}{tuple(str(a) for a in args)}")
                return _original(*args, **kwargs)
            setattr(task, name, spy)
        strategy = trainer.strategy
        original_to_device = strategy.model_to_device

        def counted() -> None:
            self.model_to_device += 1
            original_to_device()
        strategy.model_to_device = counted
        import lightning.pytorch.strategies.strategy as lightning_strategy  # where Strategy.teardown finds it
        to_device = lightning_strategy._optimizers_to_device

        def optimizers_moved(optimizers, device):
            self.moves.append(f"optimizers_to_device({device})")
            return to_device(optimizers, device)
        lightning_strategy._optimizers_to_device = optimizers_moved

    def on_test_start(self, trainer: L.Trainer, task: L.LightningModule) -> None:
        self.out.write_text(json.dumps({"moves": self.moves, "model_to_device": self.model_to_device,
                                        "module_device": str(task.device)}))
