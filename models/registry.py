"""Names for transformer blocks: the built-ins, names a user registers, or ``module:Class``."""
from __future__ import annotations

import importlib
import inspect

from torch import nn

from models.blocks import GPT2Block, LlamaBlock


class BlockRegistry:
    """A registry object (no module state is mutated behind the user's back)."""

    def __init__(self):
        self._blocks: dict[str, type] = {"gpt2": GPT2Block, "llama": LlamaBlock}

    def register(self, name: str, cls: type) -> type:
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
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"--block {spec}: cannot import module {module_name!r} ({exc}); "
                             f"check the module is on PYTHONPATH") from exc
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise ValueError(f"--block {spec}: module {module_name!r} has no class {cls_name!r}")
        return check_block_class(cls, spec)


def check_block_class(cls, spec: str) -> type:
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise ValueError(f"--block {spec}: {cls!r} is not an nn.Module subclass; a block is "
                         f"nn.Module with __init__(cfg, layer_idx, ps, ctx) and forward(x[, inputs])")
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    if params[:4] != ["cfg", "layer_idx", "ps", "ctx"]:
        raise ValueError(f"--block {spec}: __init__ takes ({', '.join(params)}), but a block must "
                         f"take (cfg, layer_idx, ps, ctx); see models/blocks.py")
    for attr, allowed in (("position", ("learned", "rope")), ("final_norm", ("layernorm", "rmsnorm")),
                          ("tie_embeddings", (True, False))):
        if getattr(cls, attr, None) not in allowed:
            raise ValueError(f"--block {spec}: class attribute {attr} must be one of {allowed}; "
                             f"subclass models.blocks.TransformerBlock to inherit defaults")
    return cls




def default_registry() -> BlockRegistry:
    return BlockRegistry()
