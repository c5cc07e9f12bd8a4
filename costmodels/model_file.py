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
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipeplan.costmodels import hf_config
from pipeplan.costmodels.meta_init import SkipInitOnMeta
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


# How an allocation failure reads: Python's MemoryError, or torch's allocator raising a RuntimeError
# ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ... bytes").
_OUT_OF_MEMORY_TEXT = ("can't allocate memory", "not enough memory", "defaultcpuallocator", "out of memory")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from, is an allocation failure rather than a bug."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError):
            return True
        if isinstance(cur, RuntimeError) and any(t in str(cur).lower() for t in _OUT_OF_MEMORY_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class OutOfMemory(UserError):
    """Building or running the model with real weights needed more memory than this machine has."""


def _ram() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return "this machine's RAM"
    return f"this machine's RAM ({total / 2**30:.0f} GiB)"


def _allocation(e: BaseException) -> str:
    """What could not be allocated, from torch's "you tried to allocate N bytes" when it says so."""
    found = re.search(r"tried to allocate (\d+) bytes", str(e))
    if found:
        return f"could not allocate {int(found.group(1)) / 2**20:,.0f} MiB more"
    return _cause(e)[:160]


def out_of_memory_error(path: str, step: str, e: BaseException) -> OutOfMemory:
    """The one message for a real out-of-memory: what happened and what to do; never "fix the model file"."""
    return OutOfMemory(
        f"{path}: {step} ran out of memory ({_allocation(e)}): with real weights the model is too big for "
        f"{_ram()}; nothing in the model file needs fixing",
        "plan it against a catalogue profile (e.g. --profile a100-80gb-sxm), which traces it without weights, "
        f"or save a graph without layer times with `pipeplan trace {path} --no-times`",
    )


def available_ram_bytes() -> int | None:
    """RAM a new allocation can still get: Linux's MemAvailable (free plus reclaimable caches), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def model_bytes(spec: ModelSpec) -> tuple[int, int] | None:
    """(weights, gradients) bytes of the model with real weights, from a build on the meta device (no memory), or
    None where it cannot be built there. Tied weights count once; buffers are weights without gradients."""
    try:
        meta = spec.build_on_meta()
    except Exception:  # noqa: BLE001 -- not buildable without memory: the real build says what is wrong
        return None
    tensors = {id(t): t for t in [*meta.parameters(), *meta.buffers()]}.values()
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return weights, sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)


def ram_shortfall(spec: ModelSpec, copies: int = 1, *, grads: bool = True) -> tuple[int, int] | None:
    """(bytes needed, bytes free) where `copies` of the model with real weights (and their gradients, with `grads`)
    exceed the RAM still free; None where they fit, or where the RAM or the model's size cannot be told.

    Why ask before building: a build past the RAM is not always an exception to catch (`out_of_memory_error`); on
    Linux the kernel's OOM killer ends the process instead, with no word of why.
    """
    free = available_ram_bytes()
    sizes = model_bytes(spec) if free is not None else None
    if free is None or sizes is None:
        return None
    need = copies * (sizes[0] + (sizes[1] if grads else 0))
    return (need, free) if need > free else None


def check_fits_in_ram(spec: ModelSpec) -> None:
    """Refuse before building a model for real whose weights and gradients alone exceed the RAM still free
    (`ram_shortfall`; `pipeplan trace` of a 70B config was killed, exit 137). Weights and gradients are the least a
    timed step holds, so this refuses only what cannot work."""
    short = ram_shortfall(spec)
    if short is not None:
        need, free = short
        raise OutOfMemory(
            f"{spec.path}: with real weights the model is too big for {_ram()}: its weights and gradients need "
            f"{need / 2**30:,.2f} GiB and {free / 2**30:,.2f} GiB is free, so building it would run "
            f"out of memory; nothing in the model file needs fixing",
            "plan it against a catalogue profile (e.g. --profile a100-80gb-sxm), which traces it without weights, "
            f"or save a graph without layer times with `pipeplan trace {spec.path} --no-times`",
        )


@contextmanager
def out_of_memory_as_user_error(path: str, step: str) -> Iterator[None]:
    """Around pipeplan's own runs of the real model: an allocation failure is an `OutOfMemory`, not a crash."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory_error(path, step, e) from e
        raise


@dataclass
class ModelSpec:
    path: str  # absolute path of model.py (or of a Hugging Face config.json)
    entry: str  # builder function name
    module: types.ModuleType
    seq_len: int | None = None  # the training sequence length of a config.json model; None for a model.py

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.module, fn_name)
        try:
            return fn(*args)
        except UserError:
            raise
        except Exception as e:  # the user's code failed: say where, not how pipeplan got there
            if is_out_of_memory(e):  # ... unless it only asked for more memory than there is
                raise out_of_memory_error(self.path, f"{fn_name}()", e) from e
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

    def build_on_meta(self) -> torch.nn.Module:
        """build() under `torch.device("meta")`: parameters and buffers get shapes and dtypes, no memory (and no
        initialiser runs: costmodels/meta_init.py)."""
        with torch.device("meta"), SkipInitOnMeta():
            return self.build()

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


def load_model_file(path: str, entry: str = "build_model", *, seq_len: int | None = None) -> ModelSpec:
    """Import `path` as a fresh module (its own name, so two model files never collide).

    A `.json` path is a Hugging Face config.json (costmodels/hf_config.py): the model is
    AutoModelForCausalLM.from_config at sequence length `seq_len` (default: the config's
    max_position_embeddings, capped). `seq_len` means nothing for a model.py.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise UserError(f"{path}: no such model file", "check the path to model.py")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a folder, not a model file", "pass the path of a .py file")
    if hf_config.is_json_path(path):
        if entry != "build_model":
            raise UserError(f"--entry {entry} only applies to a model.py, but {path} is a Hugging Face config",
                            "drop --entry")
        hf_module, hf_seq_len = hf_config.load_hf_config(path, seq_len)
        return ModelSpec(path=path, entry="build_model", module=hf_module, seq_len=hf_seq_len)
    if seq_len is not None:
        raise UserError(f"--seq-len only applies to a Hugging Face config, but {path} is a model file",
                        "drop --seq-len (example_inputs in the model file sets the shapes)")
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
