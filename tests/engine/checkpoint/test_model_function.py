"""What a checkpoint's model computes beyond its shape (norm epsilon, RoPE base, the router's top-k
and scores) is kept on --load: a run that leaves one of them at a default the checkpoint does not
hold is refused in one line; a run that sets it explicitly changes it (fine-tuning with another
RoPE base, say)."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.checkpoint.import_hf import main as import_main  # noqa: E402
from engine.checkpoint.index import CheckpointError, read_index, resolve  # noqa: E402
from engine.checkpoint.reader import check_compatible, function_differences  # noqa: E402
from engine.config.cli import parse_args  # noqa: E402
from models.config import GPTConfig  # noqa: E402
from models.registry import BlockRegistry  # noqa: E402

SHAPE = ["--block", "llama", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--seq-length", "16", "--mock-data", "--vocab-size", "64"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The index of a Llama imported from transformers with rope_theta 5e5 and rms_norm_eps 1e-6."""
    root = tmp_path_factory.mktemp("function")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=16, rms_norm_eps=1e-6,
                                   rope_theta=500000.0, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"))
    assert import_main(["--load", str(root / "hf"), "--save", str(root / "ck")]) == 0
    index = read_index(resolve(str(root / "ck")))
    assert (index["model"]["rope_base"], index["model"]["norm_eps"]) == (500000.0, 1e-6)
    return index


def test_defaults_that_differ_from_the_checkpoint_are_refused_in_one_line(imported):
    with pytest.raises(CheckpointError) as err:
        check_compatible(imported, parse_args(SHAPE), imported["data"], "ck")
    line = str(err.value)
    assert "\n" not in line
    assert "saved with --norm-eps 1e-06 and --rope-base 500000.0, where this run has the " \
           "defaults 1e-05 and 10000.0" in line, line
    with pytest.raises(CheckpointError, match=r"--rope-base 500000.0, where this run has its default"):
        check_compatible(imported, parse_args(SHAPE + ["--norm-eps", "1e-6"]), imported["data"], "ck")


def test_the_checkpoints_values_or_explicit_ones_load(imported):
    same = SHAPE + ["--norm-eps", "1e-6", "--rope-base", "500000"]
    check_compatible(imported, parse_args(same), imported["data"], "ck")
    # a deliberate change (a longer context's RoPE base): the run sets it, so it is its choice
    check_compatible(imported, parse_args(SHAPE + ["--norm-eps", "1e-6", "--rope-base", "1e6"]),
                     imported["data"], "ck")


def test_which_fields_count():
    saved = dataclasses.asdict(GPTConfig(block="gpt2", num_experts=4, rope_base=5e5,
                                         moe_router_topk=1, moe_router_score_function="sigmoid"))
    here = GPTConfig(block="gpt2", num_experts=4)
    # GPT-2 has learned positions: its RoPE base computes nothing; the router's fields do
    assert function_differences(saved, here, ()) == [
        ("--moe-router-topk", 1, 2), ("--moe-router-score-function", "sigmoid", "softmax")]
    assert function_differences(saved, here, ("moe_router_topk",)) == [
        ("--moe-router-score-function", "sigmoid", "softmax")]
    llama = dataclasses.asdict(GPTConfig(block="llama", rope_base=5e5))
    assert function_differences(llama, GPTConfig(block="llama"), ()) == [("--rope-base", 5e5, 1e4)]
    old = {k: v for k, v in llama.items() if k not in ("rope_base", "norm_eps")}  # written before
    assert function_differences(old, GPTConfig(block="llama"), ()) == []        # the fields existed


class MyRope(torch.nn.Module):
    position, final_norm, tie_embeddings = "rope", "rmsnorm", False

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()

    def forward(self, x):
        return x


def test_a_registered_rotary_block_keeps_its_rope_base():
    """The block is resolved with the run's registry (the trainer's), so a name registered there
    is known to be rotary."""
    reg = BlockRegistry()
    reg.register("myrope", MyRope)
    saved = dataclasses.asdict(GPTConfig(block="myrope", rope_base=500.0))
    assert function_differences(saved, GPTConfig(block="myrope"), (), reg) == [("--rope-base", 500.0, 1e4)]
