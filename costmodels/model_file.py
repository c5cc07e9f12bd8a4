"""Loading the user's `model.py`: the one place where user code runs, so the one place that guards it.

A model file defines `build_model() -> nn.Module` (or another builder picked with
`--entry`) and `example_inputs(batch_size) -> tuple`; optionally
`example_target(batch_size)`, `loss_fn(output, target)` and `train_batches()`.
Every failure of the user's code becomes a one-line `UserError` that names the
file, the function and the cause, because a traceback into pipeplan's internals
tells the user nothing about what to fix in *their* file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipeplan.errors import UserError


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _user_frame_line(e: BaseException, path: str) -> str:
    """' (line N)' of the deepest traceback frame inside the model file, when there is one."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


@dataclass
class ModelSpec:
    path: str  # absolute path of model.py
    entry: str  # builder function name
    module: types.ModuleType

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.module, fn_name)
        try:
            return fn(*args)
        except UserError:
            raise
        except Exception as e:  # the user's code failed: say where, not how pipeplan got there
            raise UserError(
                f"{self.path}: {fn_name}() raised {_cause(e)}{_user_frame_line(e, self.path)}",
                f"fix {fn_name} in the model file",
            ) from e

    def build(self) -> torch.nn.Module:
        model = self._call(self.entry)
        if not isinstance(model, torch.nn.Module):
            raise UserError(
                f"{self.path}: {self.entry}() returned {type(model).__name__}, not a torch.nn.Module",
                f"make {self.entry} return the model",
            )
        return model

    def example_inputs(self, batch_size: int) -> tuple[Any, ...]:
        inputs = self._call("example_inputs", batch_size)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, list):
            inputs = tuple(inputs)
        if not isinstance(inputs, tuple):
            raise UserError(
                f"{self.path}: example_inputs({batch_size}) returned {type(inputs).__name__}, not a tuple of tensors",
                "return a tuple of the model's positional inputs",
            )
        return inputs

    def example_target(self, batch_size: int) -> Any | None:
        if not callable(getattr(self.module, "example_target", None)):
            return None
        return self._call("example_target", batch_size)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """loss_fn(output, target) when the file defines both, else the sum of the output's floating tensors.

        The fallback gives every output element a gradient of one, which exercises the
        same backward ops as a real loss would for timing purposes.
        """
        loss_fn = getattr(self.module, "loss_fn", None)
        if callable(loss_fn) and target is not None:
            loss = self._call("loss_fn", output, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise UserError(
                    f"{self.path}: loss_fn() must return a scalar tensor, got {type(loss).__name__}",
                    "return the loss as a 0-dim tensor",
                )
            return loss.reshape(())
        tensors = [t for t in _flatten(output) if t.is_floating_point() and t.requires_grad]
        if not tensors:
            raise UserError(
                f"{self.path}: the output of {self.entry}() has no floating tensor that needs a gradient",
                "return the model's output tensors, or define example_target and loss_fn",
            )
        total = sum(t.float().sum() for t in tensors)
        assert isinstance(total, torch.Tensor)  # 0 + a tensor: `tensors` is not empty
        return total

    def train_batches(self) -> Iterable[Any] | None:
        if not callable(getattr(self.module, "train_batches", None)):
            return None
        batches: Iterable[Any] = self._call("train_batches")  # the user's iterable of (inputs, target), unchecked
        return batches


def _flatten(obj: Any) -> list[torch.Tensor]:
    """Tensors inside tensors, tuples, lists, dicts and Hugging Face ModelOutputs (which are dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _flatten(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _flatten(v)]
    return []


def load_model_file(path: str, entry: str = "build_model") -> ModelSpec:
    """Import `path` as a fresh module (its own name, so two model files never collide)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise UserError(f"{path}: no such model file", "check the path to model.py")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a folder, not a model file", "pass the path of a .py file")
    name = "pipeplan_user_model_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{path}: cannot be imported as Python", "pass a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling in user code look themselves up here
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)  # so the model file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise UserError(f"{path}: syntax error at line {e.lineno}: {e.msg}", "fix the model file") from e
    except UserError:
        sys.modules.pop(name, None)
        raise
    except Exception as e:
        sys.modules.pop(name, None)
        raise UserError(
            f"{path}: importing the model file raised {_cause(e)}{_user_frame_line(e, path)}",
            "fix the module-level code of the model file",
        ) from e
    finally:
        if added:
            try:
                sys.path.remove(folder)
            except ValueError:
                pass
    if not callable(getattr(module, entry, None)):
        builders = sorted(
            n for n, v in vars(module).items() if n.startswith("build") and callable(v) and not isinstance(v, type)
        )
        hint = f"define {entry}() returning the model" + (f", or pass --entry {builders[0]}" if builders else ", or pass --entry NAME")
        raise UserError(f"{path}: no function {entry}", hint)
    if not callable(getattr(module, "example_inputs", None)):
        raise UserError(f"{path}: no function example_inputs", "define example_inputs(batch_size) returning a tuple of input tensors")
    return ModelSpec(path=path, entry=entry, module=module)
