import pytest

from engine.cli import ConfigError, parse_args
from engine.validate import validate_run
from parallel.state import LaunchEnv


def test_flags_and_aliases():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--pp", "2", "--num-layers", "8",
                      "--sequence-parallel", "--precision", "bf16", "--mbs", "2", "--gbs", "8"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.model.num_layers) == (2, 2, 8)
    assert cfg.parallel.sequence_parallel and cfg.precision.precision == "bf16"
    assert (cfg.data.micro_batch_size, cfg.data.global_batch_size) == (2, 8)


def test_yaml_recipe_and_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num-layers: 6\nhidden_size: 96\nnum_attention_heads: 4\nlr: 1.0e-3\n")
    cfg = parse_args(["--config", str(recipe), "--num-layers", "2"])
    assert cfg.model.num_layers == 2 and cfg.model.hidden_size == 96 and cfg.optim.lr == 1e-3


def test_unknown_flag_and_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown argument '--num-layer'; did you mean --num-layers"):
        parse_args(["--num-layer", "3"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("hiden_size: 64\n")
    with pytest.raises(ConfigError, match="unknown key 'hiden_size'; did you mean 'hidden_size'"):
        parse_args(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("argv,world,match", [
    (["--tp", "2", "--pp", "2"], 8 - 1, "world size 7 != tp\\*pp\\*dp"),
    (["--tp", "3", "--hidden-size", "64", "--num-attention-heads", "4"], 3,
     "--num-attention-heads 4 is not divisible by --tp 3"),
    (["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "96"], 2,
     "--num-attention-heads 3 is not divisible by --tp 2"),
    (["--tp", "2", "--ffn-hidden-size", "101"], 2, "--ffn-hidden-size 101 is not divisible by --tp 2"),
    (["--tp", "2", "--sequence-parallel", "--seq-length", "63"], 2,
     "--seq-length 63 is not divisible by --tp 2"),
    (["--pp", "3", "--num-layers", "4"], 3, "--num-layers 4 is not divisible by pp x virtual"),
    (["--pp", "4", "--num-layers", "3", "--stage-end-weight", "1"], 4, "cannot split 3 layers"),
    (["--dp", "2", "--micro-batch-size", "4", "--global-batch-size", "12"], 2,
     "not divisible by micro-batch-size x dp"),
    (["--pp", "2", "--pipeline-schedule", "interleaved", "--virtual-pipeline-size", "2",
      "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "3"], 2,
     "multiple of --pp"),
    (["--data-path", "/nonexistent/corpus"], 1, "no prepared data there"),
    (["--block", "no_such_module:Block"], 1, "cannot import module"),
])
def test_validation_errors(argv, world, match):
    cfg = parse_args(argv)
    with pytest.raises(ConfigError, match=match):
        validate_run(cfg, LaunchEnv(0, world, 0, world))


def test_value_errors_are_config_errors():
    with pytest.raises(ConfigError, match="--pipeline-schedule: invalid choice: .zigzag."):
        parse_args(["--pipeline-schedule", "zigzag"])
    with pytest.raises(ConfigError, match="--seq-length 256 is longer than the position table"):
        parse_args(["--seq-length", "256", "--max-position-embeddings", "128"])
    with pytest.raises(ConfigError, match="--grad-compression-ratio must be in"):
        parse_args(["--grad-compression", "topk", "--grad-compression-ratio", "1.5"])
