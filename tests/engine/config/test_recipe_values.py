"""A recipe's values read as written (YAML 1.2's integers, the text of string fields, a list for
moe_layer_freq), and its keys spelled as command-line switches answered by their value; every
refusal is one line saying what to write instead."""
import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from tests.engine.config.test_cli import _recipe


def _refusal(tmp_path, text: str) -> str:
    recipe = _recipe(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", recipe])
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"--config {recipe}: "), message
    return message[len(f"--config {recipe}: "):]


@pytest.mark.parametrize("text,says", [
    ("bf16: false\n", "unknown key 'bf16': leave it out (precision defaults to fp32) or write "
                      "precision: fp32"),
    ("fp16: false\n", "unknown key 'fp16': leave it out (precision defaults to fp32) or write "
                      "precision: fp32"),
    ("recompute_activations: false\n", "unknown key 'recompute_activations': leave it out "
                                       "(recompute defaults to none) or write recompute: none"),
    ("bf16: true\n", "unknown key 'bf16': write precision: bf16 (--bf16 is the command line's "
                     "switch for it)"),
])
def test_a_switch_as_a_key_is_answered_by_its_value(tmp_path, text, says):
    """``bf16: false`` once got "write precision: bf16", the opposite of what it says."""
    assert _refusal(tmp_path, text) == says


@pytest.mark.parametrize("text,says", [
    ("no_load_optim: true\n", "unknown key 'no_load_optim': write load_optim: false "
                              "(--no-load-optim is the command line's switch for it)"),
    ("no_progress: true\n", "unknown key 'no_progress': write progress: false (--no-progress is "
                            "the command line's switch for it)"),
    ("checkpoint:\n  no-load-rng: true\n", "unknown key 'no-load-rng': write load_rng: false "
                                           "(--no-load-rng is the command line's switch for it)"),
    ("no_load_optim: false\n", "unknown key 'no_load_optim': write load_optim: true, or leave it "
                               "out (load_optim defaults to true)"),
    ("no_sequence_parallel: true\n", "unknown key 'no_sequence_parallel': write sequence_parallel: "
                                     "false"),
    ("tensor_model_parallel_size: 2\n", "unknown key 'tensor_model_parallel_size': the recipe's key "
                                        "is tp (--tensor-model-parallel-size is the command line's "
                                        "alias for it)"),
])
def test_megatron_no_switches_and_aliases_as_keys_name_the_key_to_write(tmp_path, text, says):
    assert _refusal(tmp_path, text).startswith(says)


def test_a_recipe_does_not_include_another(tmp_path):
    assert _refusal(tmp_path, "config: other.yaml\n") == (
        "unknown key 'config': a recipe does not include another recipe: merge its keys into this "
        "file")


@pytest.mark.parametrize("text,field,value", [
    ("num_layers: 010\n", ("model", "num_layers"), 10),        # YAML 1.1: octal 8
    ("num_layers: 0o10\n", ("model", "num_layers"), 8),
    ("num_layers: 0x10\n", ("model", "num_layers"), 16),
    ("train_iters: 10_000\n", ("optim", "train_iters"), 10000),
    ("seed: 0100\n", (None, "seed"), 100),                     # YAML 1.1: 64
    ("wandb_exp_name: 1.10\n", ("log", "wandb_exp_name"), "1.10"),  # not str(1.1)
    ("wandb_exp_name: 2024-01-01\n", ("log", "wandb_exp_name"), "2024-01-01"),
    ("wandb_exp_name: 0x1F\n", ("log", "wandb_exp_name"), "0x1F"),
    ("data_path: [0.30, a, 0.70, b]\n", ("data", "data_path"), ["0.30", "a", "0.70", "b"]),
    ("split: 98,2,0\n", ("data", "split"), "98,2,0"),
])
def test_numbers_are_read_as_written(tmp_path, text, field, value):
    """PyYAML's YAML 1.1 read ``010`` as 8 and ``1.10`` for a string field as "1.1"."""
    cfg = parse_args(["--config", _recipe(tmp_path, text)])
    section, name = field
    assert getattr(getattr(cfg, section) if section else cfg, name) == value


@pytest.mark.parametrize("text,says", [
    ("seq_length: 1:30\n", "seq_length: '1:30' is not an integer (int expected)"),  # YAML 1.1: 90
    ("num_layers: 0b11\n", "num_layers: '0b11' is not an integer (int expected)"),  # YAML 1.1: 3
    ("lr: 1:30.5\n", "lr: '1:30.5' is not a number (float expected)"),              # YAML 1.1: 90.5
    ("train_iters: 1e3\n", "train_iters: '1e3' is not an integer (int expected); write 1000"),
    ("train_iters: 1000.0\n", "train_iters: 1000.0 is not an integer (int expected); write 1000"),
    ("train_iters: 1.5\n", "train_iters: 1.5 is not an integer (int expected)"),
    ("num_layers: true\n", "num_layers: True is not an integer (int expected)"),
])
def test_other_number_forms_are_refused_saying_what_to_write(tmp_path, text, says):
    assert _refusal(tmp_path, text) == says


def test_moe_layer_freq_takes_a_yaml_list(tmp_path):
    """The command line's "[0,1,1,1]" as a YAML list (once "is not a string")."""
    from models.moe.config import moe_layer_pattern
    cfg = parse_args(["--config", _recipe(tmp_path, "num_layers: 4\nnum_experts: 4\n"
                                                    "moe_layer_freq: [0, 1, 1, 1]\n")])
    assert cfg.model.moe_layer_freq == "[0,1,1,1]"
    assert moe_layer_pattern(cfg.model.moe_layer_freq, 4) == [False, True, True, True]
    quoted = parse_args(["--config", _recipe(tmp_path, "num_layers: 4\nnum_experts: 4\n"
                                                       "moe_layer_freq: \"[0,1,1,1]\"\n")])
    assert quoted.model.moe_layer_freq == "[0,1,1,1]"
    assert _refusal(tmp_path, "num_experts: 4\nmoe_layer_freq: [0, true]\n") == (
        "moe_layer_freq: [0, True] is not a string (str expected)")
    assert _refusal(tmp_path, "wandb_exp_name: [a, b]\n") == (
        "wandb_exp_name: ['a', 'b'] is not a string or null (str expected)")
    with pytest.raises(ConfigError, match="^--moe-layer-freq \\[0,1\\]: the list needs 4 entries"):
        parse_args(["--config", _recipe(tmp_path, "num_layers: 4\nnum_experts: 4\n"
                                                  "moe_layer_freq: [0, 1]\n")])
