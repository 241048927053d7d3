"""Megatron-LM flags, values and recipe keys that gridtron does not build are answered in one line
with the gridtron way (engine/config/megatron_answers.py), never hinted as another setting; the
answers name only flags that exist, and none answers a flag that does."""
import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from tests.engine.config.test_cli import _recipe


def _real_options() -> set[str]:
    from engine.config.cli import build_parser
    return {o for a in build_parser()._actions for o in a.option_strings}


def test_megatron_answers_are_for_flags_that_do_not_exist_and_name_only_flags_that_do():
    """An answer for a flag that has since become real (``--distributed-backend``) would never be
    shown and contradicts the flag; an answer naming a flag that is not there sends the user to
    another refusal."""
    import re
    from engine.config.flags import FLAGS
    from engine.config.megatron_answers import CHOICE_ANSWERS, MEGATRON_ANSWERS
    real = _real_options()
    stale = sorted(set(MEGATRON_ANSWERS) & real)
    assert not stale, f"real flags answered as if missing (drop them from MEGATRON_ANSWERS): {stale}"
    texts = list(MEGATRON_ANSWERS.values()) + [t for v in CHOICE_ANSWERS.values() for t in v.values()]
    named = {m for text in texts for m in re.findall(r"--[a-z0-9][a-z0-9-]*", text)}
    assert not named - real, f"answers name flags that do not exist: {sorted(named - real)}"
    for name, values in CHOICE_ANSWERS.items():  # values the flag refuses, of a flag with choices
        assert FLAGS[name].choices and not set(values) & set(FLAGS[name].choices), name


@pytest.mark.parametrize("flag,says", [
    ("--fp8", "--fp8-format e4m3|hybrid"),
    ("--fp8-param-gather", "not built"),
    ("--fp8-amax-history-len", "delayed scaling (an amax history) is not built"),
    ("--fp8-amax-compute-algo", "--fp8-recipe tensorwise|rowwise"),
    ("--fp8-margin", "delayed scaling"),
    ("--use-torch-fsdp2", "--data-parallel-sharding-strategy optim_grads_params"),
    ("--use-custom-fsdp", "--data-parallel-sharding-strategy optim_grads_params"),
    ("--moe-permute-fusion", "drop the flag"),
    ("--use-precision-aware-optimizer", "fp32 master weights, gradients and AdamW moments"),
    ("--cpu-offloading", "--recompute selective|full"),
    ("--moe-enable-deepep", "--moe-token-dispatcher-type alltoall"),
])
def test_megatron_flags_of_the_newer_features_are_answered(flag, says):
    with pytest.raises(ConfigError) as exc:
        parse_args([flag, "1"] if "len" in flag or "margin" in flag else [flag])
    assert str(exc.value).startswith(f"{flag}: ") and says in str(exc.value), str(exc.value)


def test_megatron_values_of_real_flags_say_what_is_not_built(tmp_path):
    with pytest.raises(ConfigError, match="invalid choice: 'delayed'.*; delayed scaling .* is not "
                                          "built: each FP8 scale comes from the current"):
        parse_args(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"])
    with pytest.raises(ConfigError, match="fp8_recipe: 'delayed' is not one of tensorwise, rowwise, "
                                          "blockwise; delayed scaling"):
        parse_args(["--config", _recipe(tmp_path, "fp8_recipe: delayed\n")])
    with pytest.raises(ConfigError, match="invalid choice: 'flex'.*; DeepEP \\(the flex dispatcher\\) "
                                          "is not built"):
        parse_args(["--num-experts", "4", "--moe-token-dispatcher-type", "flex"])
    with pytest.raises(ConfigError) as exc:  # a value without an answer: the plain line
        parse_args(["--fp8-recipe", "zigzag"])
    assert str(exc.value) == ("argument --fp8-recipe: invalid choice: 'zigzag' (choose from "
                              "'tensorwise', 'rowwise', 'blockwise') (python -m engine.train --help "
                              "lists every flag)")


def test_megatron_global_aux_loss_is_answered_with_aux_loss(tmp_path):
    says = ("global_aux_loss'.*; aux_loss here is the global one: write "
            "--moe-router-load-balancing-type aux_loss \\(counts over each micro-step's tokens of all "
            "DP x CP ranks, not averaged over the step's micro-batches; docs/moe.md\\)")
    with pytest.raises(ConfigError, match=says):
        parse_args(["--num-experts", "4", "--moe-router-load-balancing-type", "global_aux_loss"])
    with pytest.raises(ConfigError, match=says):
        parse_args(["--config", _recipe(tmp_path, "num_experts: 4\n"
                                                  "moe_router_load_balancing_type: global_aux_loss\n")])


@pytest.mark.parametrize("text,says", [
    ("bf16: true\n", "unknown key 'bf16': write precision: bf16 (--bf16 is the command line's "
                     "switch for it)"),
    ("fp16: true\n", "unknown key 'fp16': write precision: fp16"),
    ("recompute_activations: true\n", "write recompute: selective"),
    ("mixed_precision:\n  precision: bf16\n", "unknown key 'mixed_precision': that is a group of "
                                              "--help; the recipe's section is precision: (or write "
                                              "its keys flat)"),
    ("logging:\n  log_interval: 2\n", "the recipe's section is log:"),
    ("training:\n  lr: 1.0e-3\n", "not a section; write its keys flat or under their sections "
                                  "(data:, optim:)"),
    ("fp8: hybrid\n", "unknown key 'fp8': gridtron spells it --fp8-format e4m3|hybrid"),
])
def test_recipe_keys_from_the_command_line_or_help_say_what_to_write(tmp_path, text, says):
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", _recipe(tmp_path, text)])
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


# Flags of Megatron-LM's example scripts (examples/gpt3/train_gpt3_175b_distributed.sh,
# examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh at
# d98e8a64dd) and the common Megatron flags with a gridtron equivalent or a clear instruction.
MEGATRON_SCRIPT_FLAGS = """
--attention-backend auto|--lr-warmup-fraction .001|--step-batch-size-schedule 0:16|--fp16
--apply-layernorm-1p|--calculate-per-token-loss|--ckpt-format torch_dist|--cross-entropy-loss-fusion
--data-cache-path /tmp/c|--decoupled-lr 5e-4|--decoupled-min-lr 4.5e-5|--disable-bias-linear
--distributed-timeout-minutes 60|--exit-duration-in-mins 235|--fp8-amax-compute-algo max
--fp8-amax-history-len 1024|--fp8-param-gather|--grad-reduce-in-bf16|--kv-channels 128
--log-throughput|--lr-decay-samples 100|--lr-warmup-samples 10|--manual-gc|--num-workers 1
--no-create-attention-mask-in-dataloader|--no-mmap-bin-files|--normalization RMSNorm|--profile
--position-embedding-type rope|--profile-step-end 6|--profile-step-start 4|--rotary-percent 1.0
--swiglu|--train-samples 1000|--untie-embeddings-and-output-weights|--use-mcore-models
--no-masked-softmax-fusion|--no-position-embedding|--no-load-rng|--moe-grouped-gemm
--num-layers-per-virtual-pipeline-stage 2|--ddp-bucket-size 40000000|--recompute-method uniform
--recompute-num-layers 1|--recompute-modules core_attn|--exit-interval 100|--lr-warmup-init 1e-7
--optimizer adam|--accumulate-allreduce-grads-in-fp32|--no-gradient-accumulation-fusion
--no-bias-gelu-fusion|--no-bias-dropout-fusion|--no-bias-swiglu-fusion|--bias-swiglu-fusion
--no-rope-fusion|--no-persist-layer-norm|--rotary-interleaved|--use-rope-scaling
--apply-query-key-layer-scaling|--log-timers-to-tensorboard|--log-validation-ppl-to-tensorboard
--log-memory-to-tensorboard|--log-params-norm|--log-num-zeros-in-grad|--log-world-size-to-tensorboard
--tensorboard-queue-size 1|--timing-log-level 2|--save-retain-interval 1000|--no-save-optim
--exit-on-missing-checkpoint|--wandb-entity me|--use-cpu-initialization|--rampup-batch-size 16 16 100
--dataloader-type cyclic|--check-for-nan-in-loss-and-grad|--no-check-for-nan-in-loss-and-grad
--use-legacy-models|--eval-global-batch-size 8|--eval-micro-batch-size 1|--mtp-num-layers 1
--pipeline-model-parallel-layout Et|--log-progress|--lr-wsd-decay-style exponential
--lr-wsd-decay-iters 10|--train-sync-interval 10|--tp-comm-overlap-cfg tp.yaml
--moe-router-force-load-balancing|--num-virtual-stages-per-pipeline-rank 2|--persistent-save-interval 5
"""


def test_megatron_script_flags_are_real_or_answered():
    """Each flag is gridtron's own (its value checked elsewhere) or refused with its one-line
    answer, never the generic unknown argument."""
    real = _real_options()
    lines = [line for row in MEGATRON_SCRIPT_FLAGS.strip().splitlines() for line in row.split("|")]
    generic = []
    for line in lines:
        argv = line.split()
        if argv[0] in real:
            continue
        try:
            parse_args(argv)
        except ConfigError as exc:
            if not str(exc).startswith(f"{argv[0]}: ") or "\n" in str(exc):
                generic.append(str(exc))
        else:
            generic.append(f"{line}: accepted, but it is not a gridtron flag")
    assert not generic, generic


@pytest.mark.parametrize("argv,says", [
    (["--ddp-bucket-size", "40000000"], "--bucket-size-mb N x 4 / 2^20 (Megatron's 40000000 "
                                        "elements: 152.6)"),
    (["--distributed-timeout-minutes", "30"], "--timeout-s 60 x M"),
    (["--recompute-method", "uniform"], "--recompute full recomputes every layer"),
    (["--recompute-num-layers", "1"], "--recompute full recomputes every layer"),
    (["--recompute-modules", "core_attn"], "--recompute selective recomputes the attention core"),
    (["--exit-interval", "100"], "--train-iters (a resumed run continues up to it); SIGTERM"),
    (["--exit-duration-in-mins", "230"], "SIGTERM makes the run save (with --save) and stop"),
    (["--lr-warmup-init", "1e-7"], "the warm-up starts at --lr / --lr-warmup-iters"),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "--virtual-pipeline-size num_layers / (--pp x L)"),
    (["--profile-step-start", "10"], "--profile-steps A-B"),
    (["--profile"], "--profile-steps A-B"),
    (["--save-retain-interval", "1000"], "keeps the newest --keep-last checkpoints (default 2)"),
    (["--check-for-nan-in-loss-and-grad"], "--rerun-on-anomaly"),
    (["--log-throughput"], "tokens_per_s"),
    (["--attention-backend", "flash"], "kernels are chosen per device"),
    (["--no-bias-dropout-fusion"], "kernels are chosen per device"),
    (["--optimizer", "adam"], "AdamW"),
    (["--wandb-entity", "me"], "WANDB_ENTITY"),
])
def test_common_megatron_flags_are_answered_with_the_gridtron_way(argv, says):
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(f"{argv[0]}: ") and says in str(exc.value), str(exc.value)


def test_megatron_aliases_of_vp_and_the_save_interval():
    cfg = parse_args(["--pp", "2", "--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                      "--persistent-save-interval", "5"])
    assert (cfg.parallel.virtual_pipeline_size, cfg.checkpoint.save_interval) == (2, 5)


def test_virtual_pipeline_size_implies_the_interleaved_schedule(tmp_path):
    """As in Megatron-LM, model chunks per stage select the interleaved schedule (with --pp > 1)
    unless --pipeline-schedule is given: another schedule given is refused, and the implied one is
    not the user's setting (no note about it)."""
    cfg = parse_args(["--pp", "2", "--vp", "2", "--num-layers", "4"])
    assert cfg.parallel.pipeline_schedule == "interleaved" and "pipeline_schedule" not in cfg.explicit
    recipe = _recipe(tmp_path, "parallel:\n  pp: 2\n  virtual_pipeline_size: 2\nnum_layers: 4\n")
    assert parse_args(["--config", recipe]).parallel.pipeline_schedule == "interleaved"
    assert parse_args(["--pp", "2", "--vp", "2", "--num-layers", "4", "--pipeline-schedule",
                       "zb-v"]).parallel.pipeline_schedule == "zb-v"
    assert parse_args(["--pp", "2", "--num-layers", "4"]).parallel.pipeline_schedule == "1f1b"
    with pytest.raises(ConfigError) as exc:
        parse_args(["--pp", "2", "--vp", "2", "--num-layers", "4", "--pipeline-schedule", "1f1b"])
    assert str(exc.value) == ("--pipeline-schedule 1f1b runs one model chunk per rank, not "
                              "--virtual-pipeline-size 2: drop --pipeline-schedule (interleaved is "
                              "implied) or --virtual-pipeline-size")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--vp", "2"])
    assert str(exc.value) == ("--virtual-pipeline-size 2 needs --pipeline-schedule interleaved, which "
                              "needs --pp > 1 (it is the model chunks per pipeline stage); raise --pp "
                              "or drop --virtual-pipeline-size")


@pytest.mark.parametrize("argv,value,answer", [
    (["--lr-decay-style"], "WSD", "warmup-stable-decay is not built: the decay starts when the "
                                  "warm-up ends (--lr-decay-style cosine or linear, reaching --min-lr "
                                  "at --lr-decay-iters) or never (constant)"),
    (["--lr-decay-style"], "inverse-square-root", "inverse-square-root decay is not built: the decay "
                                                  "reaches --min-lr at --lr-decay-iters (cosine or "
                                                  "linear)"),
    (["--num-experts", "4", "--moe-router-load-balancing-type"], "sinkhorn",
     "Sinkhorn routing is not built: balance with aux_loss or seq_aux_loss (and --moe-aux-loss-coeff), "
     "or without a loss by --moe-router-enable-expert-bias"),
    (["--cp-comm-type"], "a2a+p2p", "hierarchical context parallelism (a2a inside a group, p2p across "
                                    "groups) is not built: choose p2p (ring) or a2a (Ulysses) for the "
                                    "whole --cp group"),
    (["--cp-comm-type"], "allgather", "the all-gather of K/V is not built: p2p (ring attention) passes "
                                      "the K/V blocks around the --cp group instead"),
    (["--num-experts", "4", "--moe-token-dispatcher-type"], "alltoall_seq",
     "Megatron-LM's alltoall_seq (its older alltoall, since removed) is alltoall here: write "
     "--moe-token-dispatcher-type alltoall"),
])
def test_megatron_values_not_built_are_answered(tmp_path, argv, value, answer):
    flag = argv[-1]
    with pytest.raises(ConfigError) as exc:
        parse_args(argv + [value])
    assert str(exc.value).startswith(f"argument {flag}: invalid choice: '{value}' (choose from ")
    assert str(exc.value).endswith(f"; {answer} (python -m engine.train --help lists every flag)")
    key = flag[2:].replace("-", "_")
    recipe = _recipe(tmp_path, f"num_experts: 4\n{key}: {value}\n")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", recipe])
    assert str(exc.value).startswith(f"--config {recipe}: {key}: {value!r} is not one of ")
    assert str(exc.value).endswith(f"; {answer}")


def test_recipe_keys_spelled_as_a_flag_alias_name_the_key_to_write(tmp_path):
    """Every alias of FLAGS (Megatron's long names, the short ones), flat or under its section."""
    from engine.config.fields import field_table
    from engine.config.flags import FLAGS
    table = field_table()
    aliases = [(name, alias) for name, flag in FLAGS.items() if name in table for alias in flag.aliases]
    assert ("tp", "--tensor-model-parallel-size") in aliases and len(aliases) >= 20
    for name, alias in aliases:
        key = alias.lstrip("-").replace("-", "_")
        for text in (f"{key}: 1\n", f"{table[name].section}:\n  {key}: 1\n"):
            recipe = _recipe(tmp_path, text)
            with pytest.raises(ConfigError) as exc:
                parse_args(["--config", recipe])
            assert str(exc.value) == (f"--config {recipe}: unknown key {key!r}: the recipe's key is "
                                      f"{name} ({alias} is the command line's alias for it)")


@pytest.mark.parametrize("text,says", [
    ("ddp_bucket_size: 1000\n", "unknown key 'ddp_bucket_size': give the DP bucket in MiB of fp32 "
                                "gradients: --bucket-size-mb N x 4 / 2^20"),
    ("save_retain_interval: 100\n", "unknown key 'save_retain_interval': not built: gridtron keeps the "
                                    "newest --keep-last checkpoints"),
    ("eval_global_batch_size: 8\n", "unknown key 'eval_global_batch_size': validation runs"),
    ("hiden_size: 64\n", "unknown key 'hiden_size'; did you mean 'hidden_size'?"),
])
def test_recipe_keys_of_megatron_flags_get_their_answer(tmp_path, text, says):
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", _recipe(tmp_path, text)])
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_recipe_hint_only_for_a_key_that_takes_the_value(tmp_path):
    recipe = _recipe(tmp_path, "hiden_size: wide\n")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", recipe])
    assert str(exc.value) == f"--config {recipe}: unknown key 'hiden_size'"


def test_bucket_size_is_in_mib_and_etp_with_tp_1_says_what_to_change():
    from engine.config.cli import build_parser
    help_text = " ".join(build_parser().format_help().split())
    assert "--bucket-size-mb X size of a DP gradient bucket in MiB of fp32 gradients" in help_text
    with pytest.raises(ConfigError) as exc:
        parse_args(["--expert-tensor-parallel-size", "2"])
    assert str(exc.value) == ("--expert-tensor-parallel-size 2: only 1 (each expert whole on one rank) "
                              "or --tp 1 (the TP group splits every expert) is built; raise --tp to 2 "
                              "or drop the flag")
