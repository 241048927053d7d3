"""Names for transformer blocks: the built-ins, names a user registers, or ``module:Class``."""
from __future__ import annotations

import importlib
import inspect
import traceback

from torch import nn

from models.blocks import GPT2Block, LlamaBlock, called_forward, takes_attention_inputs

# the names the engine's formulas, planner, exporter and checkpoints take for these classes
BUILTIN_BLOCKS: dict[str, type] = {"gpt2": GPT2Block, "llama": LlamaBlock}
CONTRACT = "nn.Module with __init__(cfg, layer_idx, ps, ctx) and forward(x[, inputs])"


class BlockRegistry:
    """A registry object (no module state is mutated behind the user's back)."""

    def __init__(self):
        self._blocks: dict[str, type] = dict(BUILTIN_BLOCKS)

    def register(self, name: str, cls: type) -> type:
        if name in BUILTIN_BLOCKS:
            raise ValueError(f"cannot register {name!r}: it is a built-in block, and checkpoints, "
                             f"export and the planner would take your class for it; register it "
                             f"under a name of its own (e.g. 'my-{name}')")
        if ":" in name:
            raise ValueError(f"cannot register {name!r}: a name with ':' means module:Class; "
                             f"register a name without ':', or pass --block module:Class directly")
        check_block_class(cls, name)
        self._blocks[name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self._blocks)

    def resolve(self, spec: str) -> type:
        if spec in self._blocks:
            return self._blocks[spec]
        if ":" not in spec:
            raise ValueError(f"unknown --block {spec!r}; use one of {', '.join(self.names())} "
                             f"or module:Class for your own block")
        module_name, _, cls_name = spec.partition(":")
        module = import_block_module(spec, module_name)
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise ValueError(f"--block {spec}: module {module_name!r} has no class {cls_name!r}")
        return check_block_class(cls, spec)


def import_block_module(spec: str, module_name: str):
    """``module_name`` imported; a failure as one line: a module that is not found (PYTHONPATH),
    or the module's own error with its file:line (a syntax error, a failing import inside it)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or module_name == exc.name or module_name.startswith(f"{exc.name}."):
            raise ValueError(f"--block {spec}: cannot import module {module_name!r} ({exc}); "
                             f"check the module is on PYTHONPATH") from exc
        failure = exc
    except Exception as exc:  # noqa: BLE001 - any error of the user's module, reported in one line
        failure = exc
    raise ValueError(f"--block {spec}: importing module {module_name!r} failed at "
                     f"{_where(failure)}: {type(failure).__name__}: {_message(failure)}") from failure


def _message(exc: BaseException) -> str:
    return exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)


def _where(exc: BaseException) -> str:
    """file:line of the error: a syntax error's own, else the innermost frame outside the import
    machinery."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and f.filename != __file__]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def check_block_class(cls, spec: str) -> type:
    """``cls`` if the engine can build it as ``cls(cfg, layer_idx, ps, ctx)`` and call it with x
    (and x, inputs if it takes them), with the class attributes the model reads; else a
    ValueError that says what is expected."""
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise ValueError(f"--block {spec}: {cls!r} is not an nn.Module subclass; a block is {CONTRACT}")
    _check_constructor(cls, spec)
    _check_forward(cls, spec)
    for attr, allowed in (("position", ("learned", "rope")), ("final_norm", ("layernorm", "rmsnorm")),
                          ("tie_embeddings", (True, False))):
        if getattr(cls, attr, None) not in allowed:
            raise ValueError(f"--block {spec}: class attribute {attr} must be one of {allowed}; "
                             f"subclass models.blocks.TransformerBlock to inherit defaults")
    return cls


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): not checked
        return None


def _check_constructor(cls, spec: str) -> None:
    sig = _signature(cls)
    if sig is None:
        return
    try:
        sig.bind(object(), 0, object(), object())  # the engine calls cls(cfg, layer_idx, ps, ctx)
    except TypeError as exc:
        raise ValueError(f"--block {spec}: __init__{sig} cannot be called as "
                         f"{cls.__name__}(cfg, layer_idx, ps, ctx) ({exc}); a block must take "
                         f"(cfg, layer_idx, ps, ctx) positionally; see docs/blocks.md") from exc


def _check_forward(cls, spec: str) -> None:
    fn = called_forward(cls)
    if fn is nn.Module.forward:
        raise ValueError(f"--block {spec}: {cls.__name__} defines no forward; a block is {CONTRACT}")
    sig = _signature(fn)
    if sig is None:
        return
    calls = [("x", (object(), object()))]
    if takes_attention_inputs(cls):
        calls.append(("x, inputs", (object(), object(), None)))
    for args, values in calls:
        try:
            sig.bind(*values)  # self, x[, inputs]
        except TypeError as exc:
            raise ValueError(f"--block {spec}: {fn.__qualname__}{sig} cannot be called as "
                             f"{fn.__name__}({args}) ({exc}); the engine calls a block with x "
                             f"(b, s[/tp], h), and with x, inputs where it takes them: define "
                             f"forward(self, x, inputs=None)") from exc


def default_registry() -> BlockRegistry:
    return BlockRegistry()
