"""A user's own block (docs/blocks.md): what the registry accepts and refuses, the chunk's
recomputation of a block that does not recompute itself, its output-shape check, and a block's
own TP-sharded parameter in a checkpoint."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from engine.base import ConfigError
from engine.checkpoint import CheckpointError
from engine.checkpoint.specs import param_specs
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from models.blocks import TransformerBlock, recomputes_itself, takes_attention_inputs
from models.config import GPTConfig
from models.gpt import GPTChunk
from models.layers import LayerContext
from models.registry import BlockRegistry
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.helpers.blocks import Shrink, XOnly

HERE = "tests.models.test_user_blocks"
TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "0"]


class ExtraCtorArg(TransformerBlock):
    def __init__(self, cfg, layer_idx, ps, ctx, width):  # the engine passes four arguments
        super().__init__(cfg, layer_idx, ps, ctx)


class VarArgsCtor(TransformerBlock):
    def __init__(self, *args, **kwargs):  # a pass-through: valid
        super().__init__(*args, **kwargs)


class RenamedCtor(TransformerBlock):
    def __init__(self, config, idx, ps, ctx):  # other names, called positionally: valid
        super().__init__(config, idx, ps, ctx)


class NoForwardArgs(XOnly):
    def forward(self):
        return None


class InputsRequired(XOnly):
    def forward(self, x, inputs):  # called as block(x) where there are no per-token inputs
        return x


class ForwardOverrideXOnly(TransformerBlock):
    def forward(self, x):  # overrides forward itself: takes x alone, whatever _forward takes
        return self._forward(x)


class RopeXOnly(XOnly):
    position, final_norm, tie_embeddings = "rope", "rmsnorm", False


def test_builtin_names_and_module_specs_cannot_be_registered():
    reg = BlockRegistry()
    for name in ("gpt2", "llama"):
        with pytest.raises(ValueError, match=f"cannot register '{name}': it is a built-in block.*"
                                             f"name of its own"):
            reg.register(name, VarArgsCtor)
    with pytest.raises(ValueError, match="a name with ':' means module:Class"):
        reg.register("mine:Block", VarArgsCtor)
    assert reg.register("mine", VarArgsCtor) is VarArgsCtor and reg.resolve("gpt2").__name__ == "GPT2Block"


def test_a_constructor_with_an_extra_argument_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"cannot be called as ExtraCtorArg\(cfg, layer_idx, ps, ctx\) "
                                          r"\(missing a required argument: 'width'\)"):
        validate_run(parse_args(["--block", f"{HERE}:ExtraCtorArg"]), LaunchEnv())


@pytest.mark.parametrize("name", ["VarArgsCtor", "RenamedCtor"])
def test_constructors_the_engine_can_call_are_accepted(name):
    validate_run(parse_args(["--block", f"{HERE}:{name}"]), LaunchEnv())


@pytest.mark.parametrize("name,call", [("NoForwardArgs", r"forward\(x\)"), ("InputsRequired", r"forward\(x\)")])
def test_forward_checked_by_calling_signature(name, call):
    with pytest.raises(ValueError, match=f"--block {HERE}:{name}: .* cannot be called as {call}"):
        BlockRegistry().resolve(f"{HERE}:{name}")


def test_a_forward_override_taking_x_is_called_with_x():
    assert not takes_attention_inputs(ForwardOverrideXOnly) and takes_attention_inputs(TransformerBlock)
    with pytest.raises(ConfigError, match="--reset-attention-mask needs per-token metadata"):
        validate_run(parse_args(TINY + ["--block", f"{HERE}:ForwardOverrideXOnly",
                                        "--reset-attention-mask"]), LaunchEnv())


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes ``name.py`` with ``source`` on sys.path; returns its path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return str(path)
    return write


def test_an_error_importing_the_users_module_is_one_line(user_module):
    cases = [("ub_syntax", "x = 1\ndef broken(:\n", "SyntaxError: invalid syntax", 2),
             ("ub_raises", "import os\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here", 2),
             ("ub_dep", "import ub_not_installed_anywhere\n",
              "ModuleNotFoundError: No module named 'ub_not_installed_anywhere'", 1)]
    for name, source, what, line in cases:
        path = user_module(name, source)
        with pytest.raises(ValueError) as err:
            BlockRegistry().resolve(f"{name}:Block")
        text = str(err.value)
        assert text == f"--block {name}:Block: importing module '{name}' failed at {path}:{line}: {what}"
    with pytest.raises(ValueError, match="cannot import module 'ub_absent'.*PYTHONPATH"):
        BlockRegistry().resolve("ub_absent:Block")


def run(argv: list[str], hook_path: str | None = None):
    """(per-step losses, calls of the module at ``hook_path`` in layer 0 per micro-batch)."""
    trainer = Trainer(parse_args(TINY + argv))
    try:
        calls = []
        if hook_path:
            trainer.chunks[0].layers[0].get_submodule(hook_path).register_forward_hook(
                lambda *_: calls.append(1))
        losses = [r["loss"] for r in trainer.train().records]
        return losses, len(calls) / (len(losses) * trainer.num_micro)
    finally:
        trainer.close()


def test_full_recompute_of_a_block_that_does_not_recompute_itself():
    assert not recomputes_itself(XOnly) and recomputes_itself(TransformerBlock)
    assert not recomputes_itself(ForwardOverrideXOnly)
    block = ["--block", "tests.helpers.blocks:XOnly", "--train-iters", "2"]
    plain, once = run(block, "mlp.fc1")
    recomputed, twice = run(block + ["--recompute", "full"], "mlp.fc1")
    assert (once, twice) == (1, 2)  # the forward, then its recomputation in backward
    assert recomputed == plain


def test_handles_recompute_leaves_it_to_the_block():
    class Own(XOnly):
        handles_recompute = True
    assert recomputes_itself(Own)
    reg = BlockRegistry()
    reg.register("own", Own)
    trainer = Trainer(parse_args(TINY + ["--block", "own", "--recompute", "full"]), registry=reg)
    try:
        assert not trainer.chunks[0].checkpoint_layers
    finally:
        trainer.close()


def chunk(block_cls, sp: bool) -> GPTChunk:
    reg = BlockRegistry()
    reg.register("user", block_cls)
    cfg = GPTConfig(block="user", num_layers=2, hidden_size=32, num_attention_heads=4,
                    seq_length=16, vocab_size=64)
    ctx = LayerContext(Initializer(0, cfg.init_std), sequence_parallel=sp)
    return GPTChunk(cfg, ParallelState.serial(), ctx, range(2), registry=reg)


@pytest.mark.parametrize("sp", [False, True])
def test_a_block_must_return_its_inputs_shape(sp):
    tokens = torch.randint(0, 64, (2, 16))
    contract = r"\(b, s/tp, h\) under --sequence-parallel" if sp else r"see docs/blocks.md"
    with pytest.raises(ValueError, match=r"--block user: layer 0 returned shape \(2, 15, 32\) for an "
                                         r"input of shape \(2, 16, 32\); a block must return its "
                                         rf"input's shape.*{contract}"):
        chunk(Shrink, sp)(tokens, tokens)
    good = chunk(XOnly, sp)
    good(tokens, tokens)
    assert good.layer_shapes_checked  # checked on the first forward only


def test_a_blocks_own_tp_shard_is_saved_as_the_logical_tensor():
    """What ``ShardedScale`` draws on TP rank 1 of 2: marked, so the checkpoint's spec holds the
    logical (8,) tensor, this rank writing its box at offset 4 (a replicated one would be
    TP rank 0's (4,) slice)."""
    p = Initializer(0).param("layers.0.hscale", (8,), "ones", shard_dim=0, rank=1, size=2)
    holder = SimpleNamespace(modules=lambda: [], pre_process=True,
                             logical_named_parameters=lambda: [("layers.0.hscale", p)])
    spec, = param_specs([holder], SimpleNamespace(tp_rank=1, tp_size=2), 64)
    assert (spec.global_shape, spec.offsets, spec.writer) == ([8], [4], True)
    assert (p.tp_sharded, p.tp_shard_dim) == (True, 0)
    whole = Initializer(0).param("layers.0.hscale", (8,), "ones", shard_dim=0, rank=0, size=1)
    assert not getattr(whole, "tp_sharded", False)  # one rank: the whole tensor


def test_a_registered_rope_blocks_base_is_checked_on_resume(tmp_path):
    reg = BlockRegistry()
    reg.register("myrope", RopeXOnly)
    save = ["--block", "myrope", "--train-iters", "1", "--save", str(tmp_path / "ck")]
    trainer = Trainer(parse_args(TINY + save + ["--rope-base", "500"]), registry=reg)
    try:
        trainer.train()
    finally:
        trainer.close()
    resume = ["--block", "myrope", "--train-iters", "2", "--load", str(tmp_path / "ck")]
    trainer = Trainer(parse_args(TINY + resume), registry=reg)
    try:
        with pytest.raises(CheckpointError, match="saved with --rope-base 500.0, where this run has "
                                                  "its default 10000.0"):
            trainer.train()
    finally:
        trainer.close()



def test_the_guides_example_block_trains():
    """docs/blocks.md's layer-scale block, as written there: registered, built, and trained."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "blocks.md").read_text()
    source = text.split("## Example: layer scale")[1].split("```python\n")[1].split("```")[0]
    scope: dict = {}
    exec(compile(source, "docs/blocks.md", "exec"), scope)
    reg = BlockRegistry()
    reg.register("layer-scale", scope["LayerScaleBlock"])
    trainer = Trainer(parse_args(TINY + ["--block", "layer-scale", "--train-iters", "2"]), registry=reg)
    try:
        names = dict(trainer.chunks[0].logical_named_parameters())
        assert names["layers.1.ls2"].shape == (32,) and len(trainer.train().records) == 2
    finally:
        trainer.close()
