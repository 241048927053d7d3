"""Flags the command line does not take: every one named in the one line (a ported script's flags
all show in one run), Megatron-LM's answered with the gridtron way, and a mapping flag's value
that is not a JSON object refused in one line."""
import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from tests.engine.config.test_cli import _recipe

HINT = " (python -m engine.train --help lists every flag)"


def _message(argv) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert "\n" not in str(exc.value), str(exc.value)
    return str(exc.value)


def test_every_unknown_flag_is_named_in_one_line():
    """Only the first used to be reported: a Megatron script took one run per flag."""
    from engine.config.megatron_answers import MEGATRON_ANSWERS as A
    message = _message(["--use-flash-attn", "--num-layers", "2", "--swiglu", "--empty-unused-memory-level",
                        "1", "--num-layer", "3", "--foo-bar", "--train-samples", "5"])
    assert message == (
        f"6 unknown arguments: (1) --use-flash-attn: {A['--use-flash-attn']}; (2) --swiglu: "
        f"{A['--swiglu']}; (3) --empty-unused-memory-level: {A['--empty-unused-memory-level']}; "
        f"(4) --num-layer: no such flag; did you mean --num-layers?; (5) --foo-bar: no such flag; "
        f"(6) --train-samples: {A['--train-samples']}{HINT}")


def test_answered_flags_alone_keep_their_one_line_and_repeats_count_once():
    from engine.config.megatron_answers import MEGATRON_ANSWERS as A
    assert _message(["--swiglu", "--manual-gc"]) == (
        f"2 unknown arguments: (1) --swiglu: {A['--swiglu']}; (2) --manual-gc: {A['--manual-gc']}")
    assert _message(["--swiglu", "--swiglu"]) == f"--swiglu: {A['--swiglu']}"
    assert _message(["--bogus"]) == f"unknown argument '--bogus'{HINT}"
    assert _message(["--num-layers", "2", "3"]) == (
        f"unexpected value '3': every flag takes one value except --data-path{HINT}")
    assert _message(["--num-layers", "2", "3", "--bogus=1"]) == (
        f"2 unknown arguments: (1) unexpected value '3': every flag takes one value except "
        f"--data-path; (2) --bogus: no such flag{HINT}")


@pytest.mark.parametrize("argv,says", [
    (["--empty-unused-memory-level", "2"], "never emptied during the run (Megatron's level 0"),
    (["--no-save-rng"], "always hold each rank's random states"),
    (["--no-save-rng"], "--no-load-rng"),
    (["--train-data-path", "0.5", "a", "0.5", "b"], "give the training data with --data-path"),
    (["--valid-data-path", "v"], "--split W_TRAIN,W_VALID,W_TEST takes them from --data-path"),
    (["--test-data-path", "t"], "separate validation or test data is not built"),
    (["--overlap-p2p-communication"], "waited for only by the compute step that consumes it"),
    (["--no-overlap-p2p-communication"], "always posted without waiting"),
    (["--ckpt-fully-parallel-save"], "written once, by DP rank 0"),
    (["--ckpt-fully-parallel-load"], "only the parts of the tensors its own shards cover"),
    (["--dist-ckpt-strictness", "log_all"], "stops the load with one line naming it"),
    (["--rerun-mode", "validate_results"], "--rerun-on-anomaly"),
    (["--deterministic-mode"], "a deterministic mode is not built"),
    (["--fp32-residual-connection"], "an fp32 residual stream is not built"),
    (["--use-checkpoint-opt_param-scheduler"], "never taken from the checkpoint"),
    (["--override-opt_param-scheduler"], "always so: the learning rate follows this run's --lr"),
    (["--log-learning-rate-to-tensorboard"], "(lr, train/lr)"),
    (["--no-log-learning-rate-to-tensorboard"], "(lr, train/lr)"),
    (["--log-loss-scale-to-tensorboard"], "(loss_scale, train/loss_scale"),
    (["--local-rank=0"], "LOCAL_RANK, which torchrun sets"),
    (["--local_rank=0"], "LOCAL_RANK, which torchrun sets"),
    (["--moe-router-topk-scaling-factor", "2.5"], "no further factor"),
])
def test_more_megatron_flags_are_answered(argv, says):
    message = _message(argv)
    assert message.startswith(argv[0].split("=")[0] + ": ") and says in message, message


def test_a_megatron_flag_as_a_recipe_key_gets_its_answer(tmp_path):
    recipe = _recipe(tmp_path, "train_data_path: data/x\n")
    assert _message(["--config", recipe]).startswith(
        f"--config {recipe}: unknown key 'train_data_path': give the training data with --data-path")


@pytest.mark.parametrize("value,says", [
    ("{bad", "not a JSON object: '{bad' (Expecting property name enclosed in double quotes at "
             "column 2)"),
    ('"int8"', "not a JSON object: '\"int8\"' is a string"),
    ("[1,2]", "not a JSON object: '[1,2]' is an array"),
    ("3", "not a JSON object: '3' is a number"),
    ('{"default":\n', "not a JSON object: '{\"default\":\\n' (Expecting value at line 2 column 1)"),
])
def test_grad_compression_policy_must_be_a_json_object(value, says):
    """Any JSON passed (a string or a list reached the policy check naming another flag), and bad
    JSON said "invalid loads value"."""
    assert _message(["--grad-compression-policy", value]) == (
        f"argument --grad-compression-policy: {says}; give an object such as "
        f"'{{\"default\": \"int8\"}}', or null for none{HINT}")


def test_grad_compression_policy_object_or_null(tmp_path):
    cfg = parse_args(["--grad-compression-policy", '{"default": "int8"}'])
    assert cfg.compression.grad_compression_policy == {"default": "int8"}
    recipe = _recipe(tmp_path, "grad_compression_policy:\n  default: int8\n")
    assert parse_args(["--config", recipe]).compression.grad_compression_policy == {"default": "int8"}
    cleared = parse_args(["--config", recipe, "--grad-compression-policy", "null"])
    assert cleared.compression.grad_compression_policy is None
    # a misspelt flag is hinted only with a value the flag takes
    assert _message(["--grad-compression-polcy", "{bad"]) == (
        f"unknown argument '--grad-compression-polcy'{HINT}")
    assert _message(["--grad-compression-polcy", "{}"]) == (
        f"unknown argument '--grad-compression-polcy'; did you mean --grad-compression-policy?{HINT}")
