import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv


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
    # refused while parsing, before any process group (build_schedule would refuse it only then)
    with pytest.raises(ConfigError, match="interleaved needs --virtual-pipeline-size >= 2 .*got 1"):
        parse_args(["--pp", "2", "--pipeline-schedule", "interleaved"])


# ---- a command line that explains itself ------------------------------------------------------

def test_every_flag_has_help_a_group_and_its_default():
    from engine.config.cli import build_parser
    from engine.config.fields import field_table
    from engine.config.flags import FLAGS, GROUPS
    missing = [name for name in field_table() if not (FLAGS.get(name) and FLAGS[name].help)]
    assert not missing, f"add help for these config fields to engine/config/flags.py FLAGS: {missing}"
    assert all(FLAGS[n].group in GROUPS for n in field_table())
    parser = build_parser()
    for action in parser._actions:
        if action.dest not in ("help", "_implied"):
            assert action.help, f"{action.option_strings} has no help"
    text = parser.format_help()
    positions = [text.index(f"\n{g}:\n") for g in GROUPS]
    assert positions == sorted(positions)  # grouped as Megatron groups them, in that order
    assert "--precision {fp32,bf16,fp16}" in text and "(default: fp32)" in text
    assert "--lr-decay-style {cosine,linear,constant}" in text and "(default: cosine)" in text
    assert "(default: world / (tp x cp x pp))" in text  # a derived default says how it is derived


def test_megatron_spellings():
    from engine.config.fields import field_table
    cfg = parse_args(["--bf16", "--lr-decay-style", "linear", "--lr-decay-iters", "50", "--split", "98,2,0",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--finetune", "--load", "ck", "--no-load-optim",
                      "--recompute-activations", "--hidden-dropout", "0.1", "--init-method-std", "0.01"])
    assert cfg.precision.precision == "bf16" and cfg.optim.lr_decay_style == "linear"
    assert cfg.optim.lr_decay_iters == 50 and cfg.data.split == "98,2,0"
    assert cfg.data.tokenizer_type == "HuggingFaceTokenizer" and cfg.parallel.recompute == "selective"
    assert cfg.checkpoint.finetune and not cfg.checkpoint.load_optim
    assert cfg.model.dropout == 0.1 and cfg.model.init_std == 0.01
    assert parse_args(["--fp16"]).precision.precision == "fp16"
    with pytest.raises(ConfigError, match="invalid choice: 'WSD'.*; warmup-stable-decay is not built"):
        parse_args(["--lr-decay-style", "WSD"])
    if "num_query_groups" in field_table():  # grouped-query attention has landed
        assert parse_args(["--num-query-groups", "2", "--group-query-attention"]).model.num_query_groups == 2
    else:
        with pytest.raises(ConfigError, match="^--num-query-groups: grouped-query attention is not available"):
            parse_args(["--num-query-groups", "2"])
    with pytest.raises(ConfigError, match="^--use-flash-attn: kernels are chosen per device"):
        parse_args(["--use-flash-attn"])
    with pytest.raises(ConfigError, match="--block llama"):
        parse_args(["--swiglu"])


def test_lr_decay_iters_ends_the_decay_early():
    from engine.training.lr_schedule import learning_rate
    o = parse_args(["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "0", "--train-iters", "100",
                    "--lr-decay-style", "linear", "--lr-decay-iters", "50"]).optim
    assert learning_rate(25, o) == pytest.approx(0.55) and learning_rate(50, o) == learning_rate(99, o) == 0.1


@pytest.mark.parametrize("flag,value,meant", [
    ("--num-layer", "1", "--num-layers"), ("--hiden-size", "1", "--hidden-size"),
    ("--global-batch", "1", "--global-batch-size"), ("--sequence-paralel", "1", "--sequence-parallel"),
    ("--tensor-parallel-size", "1", "--tensor-model-parallel-size"),
    ("--numlayers", "1", "--num-layers"), ("--hidden-szie", "1", "--hidden-size"),
    ("--tensorboard-dri", "tb", "--tensorboard-dir"), ("--lr-decay-stlye", None, "--lr-decay-style"),
    ("--model-parallel-size", "2", "--tensor-model-parallel-size"),  # Megatron-LM's old spelling
    ("--xp", "1", None), ("--foo-bar", "1", None), ("--log-dir", "1", None), ("--layers", "1", None),
    ("--lr-decay", "1", None), ("--lr-decay", "1e-7", None),
    # a name with a word of its own names another setting (Megatron-LM flags without an answer)
    ("--moe-expert-rank-capacity-factor", "1", None), ("--start-weight-decay", "0.1", None),
    ("--inference-moe-token-dispatcher-type", "nvls", None), ("--rl-profile-dir", "d", None),
    ("--rl-inference-tensor-model-parallel-size", "2", None),
    ("--moe-shared-expert-glu-interleave-size", "2", None), ("--no-tp-comm-bulk-wgrad", None, None),
    # a flag that cannot take the value given is not the one meant
    ("--num-layer", "1e-7", None), ("--lr-warmup-iter", "0.5", None), ("--num-layer=x", None, None),
])
def test_unknown_flag_hints_only_the_flag_meant(flag, value, meant):
    with pytest.raises(ConfigError) as exc:
        parse_args([flag] + ([value] if value else []))
    hint = f"; did you mean {meant}?" if meant else ""
    assert str(exc.value) == (f"unknown argument {flag.split('=')[0]!r}{hint} (python -m "
                              f"engine.train --help lists every flag)")


@pytest.mark.parametrize("flag,value,misread", [
    ("--lr-warmup-init", "1e-7", "--lr-warmup-iters"),
    ("--eval-global-batch-size", "8", "--global-batch-size"),
    ("--eval-micro-batch-size", "1", "--micro-batch-size"),
    ("--mtp-num-layers", "1", "--num-layers"),
    ("--pipeline-model-parallel-layout", "Et*2|(tt|)*2,m|L", "--pipeline-model-parallel-size"),
    ("--no-position-embedding", None, "--max-position-embeddings"),
    ("--log-progress", None, "--no-progress"),
    ("--lr-wsd-decay-style", "exponential", "--lr-decay-style"),
    ("--lr-wsd-decay-iters", "10", "--lr-decay-iters"),
    ("--train-sync-interval", "10", "--host-sync-interval"),
    ("--tp-comm-overlap-cfg", "tp.yaml", "--tp-comm-overlap"),
    ("--moe-router-force-load-balancing", None, "--moe-router-load-balancing-type"),
    ("--no-tp-comm-overlap-ag", None, "--no-tp-comm-overlap"),
    ("--profile-step-start", "4", "--profile-steps"),
    ("--fp4-recipe", "nvfp4", "--fp8-recipe"),
])
def test_megatron_flags_once_misread_are_answered_and_never_hinted_as_another(flag, value, misread):
    """Each once got "did you mean MISREAD?", a flag of another meaning: now its answer, and
    ``suggest`` alone no longer offers that flag (each adds a word of its own)."""
    from engine.config.cli import build_parser, _option_candidates
    from engine.config.fields import suggest
    from engine.config.flags import MEGATRON_ANSWERS
    with pytest.raises(ConfigError) as exc:
        parse_args([flag] + ([value] if value else []))
    assert str(exc.value) == f"{flag}: {MEGATRON_ANSWERS[flag]}"
    assert suggest(flag, _option_candidates(build_parser())) is None


def _recipe(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_are_checked_against_the_config_types(tmp_path):
    cfg = parse_args(["--config", _recipe(tmp_path, "lr: 3e-4\nmin_lr: 0\nnum_layers: 3\nmock_data: true\n"
                                                    "data_path: 0.5 a 0.5 b\n")])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.min_lr, float) and cfg.model.num_layers == 3
    assert cfg.data.mock_data is True and cfg.data.data_path == ["0.5", "a", "0.5", "b"]
    cfg = parse_args(["--config", _recipe(tmp_path, "data_path: [0.3, a, 0.7, b]\n")])
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    cases = [("num_layers: 2.7\n", "num_layers: 2.7 is not an integer \\(int expected\\)"),
             ('mock_data: "false"\n', "mock_data: 'false' is not true or false \\(bool expected\\)"),
             ("lr: fast\n", "lr: 'fast' is not a number \\(float expected\\)"),
             ("num_layers: true\n", "num_layers: True is not an integer"),
             ("precision: fp8\n", "precision: 'fp8' is not one of fp32, bf16, fp16"),
             ("tp: null\n", "tp: None is not an integer"),
             ("model:\n  lr: 1.0\n", "'lr' is not a model key; it belongs under optim:"),
             ("model: 3\n", "model: expected a mapping of model keys"),
             ("optim:\n  lr: 1.0\nlr: 2.0\n", "lr is given twice")]
    for text, match in cases:
        with pytest.raises(ConfigError, match=match):
            parse_args(["--config", _recipe(tmp_path, text)])


def test_yaml_sections_and_malformed_files(tmp_path):
    cfg = parse_args(["--config", _recipe(tmp_path, "model:\n  num_layers: 2\n  hidden_size: 96\n"
                                                    "parallel:\n  tp: 2\noptim:\n  lr: 1.0e-3\n"
                                                    "precision:\n  precision: bf16\nseed: 7\n")])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.parallel.tp) == (2, 96, 2)
    assert cfg.optim.lr == 1e-3 and cfg.precision.precision == "bf16" and cfg.seed == 7
    assert parse_args(["--config", _recipe(tmp_path, "precision: fp16\n")]).precision.precision == "fp16"
    path = _recipe(tmp_path, "num_layers: 2\nhidden_size: [64\nlr: 1\n")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", path])
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"--config {path}:") and "malformed YAML" in message
    line, column = message.split(":")[1:3]
    assert (int(line), int(column)) == (3, 3)


def test_run_dir_is_the_root_of_every_output(tmp_path):
    cfg = parse_args(["--config", "configs/train_3d.yaml"])
    outputs = [cfg.log.metrics_file, cfg.log.timeline, cfg.log.plot, cfg.checkpoint.save]
    assert cfg.log.run_dir == "runs/3d" and all(p.startswith("runs/3d/") for p in outputs), outputs
    serial = parse_args(["--config", "configs/train_3d.yaml", "--tp", "1", "--pp", "1", "--run-dir", "runs/serial"])
    outputs = [serial.log.metrics_file, serial.log.timeline, serial.log.plot, serial.checkpoint.save,
               serial.log.compile_cache_root]
    assert all(p.startswith("runs/serial") for p in outputs), outputs
    makefile = open("Makefile").read()
    assert "--config configs/train_3d.yaml --tp 1 --pp 1 --run-dir runs/serial" in makefile
    explicit = parse_args(["--run-dir", str(tmp_path), "--save", str(tmp_path / "elsewhere")])
    assert explicit.checkpoint.save == str(tmp_path / "elsewhere")
    assert explicit.log.metrics_file == str(tmp_path / "metrics.jsonl")
    bare = parse_args([])
    assert bare.checkpoint.save is None and bare.log.metrics_file is None  # no run dir: nothing written


def test_late_errors_come_early(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--save .*is a file, not a directory; choose a directory"):
        validate_run(parse_args(["--save", str(tmp_path / "file" / "ck")]), LaunchEnv(0, 1, 0, 1))
    with pytest.raises(ConfigError, match="--tensorboard-dir .*is a file"):
        validate_run(parse_args(["--tensorboard-dir", str(tmp_path / "file" / "tb")]), LaunchEnv(0, 1, 0, 1))
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="^--device cuda, but this torch .* sees no CUDA device"):
            validate_run(parse_args(["--device", "cuda"]), LaunchEnv(0, 1, 0, 1))


def test_switches_and_their_field_agree_or_are_refused():
    # the same value twice, or a plain flag repeated (the last wins, as for every flag), is fine
    assert parse_args(["--bf16", "--precision", "bf16"]).precision.precision == "bf16"
    assert parse_args(["--precision", "fp32", "--precision", "fp16"]).precision.precision == "fp16"
    assert parse_args(["--recompute-activations", "--recompute", "selective"]).parallel.recompute == "selective"
    with pytest.raises(ConfigError) as info:
        parse_args(["--bf16", "--precision", "bf16", "--fp16"])
    assert str(info.value) == ("--bf16 and --fp16 contradict each other (both set --precision); "
                               "give one")


def test_every_float_flag_refuses_nan_and_infinity(tmp_path):
    """nan and inf pass every ``x > 0`` check, so each float field is checked finite at parse time
    (one line naming the flag), on the command line and in a recipe alike; the MoE fields with
    --num-experts (without it they are refused as needing it)."""
    from engine.config.cli import option_name
    from engine.config.fields import field_table
    floats = [name for name, info in field_table().items() if info.type is float]
    assert {"lr", "moe_expert_capacity_factor", "timeout_s", "peak_tflops", "rope_base"} <= set(floats)
    for name in floats:
        flag = option_name(name)
        moe = ["--num-experts", "4"] if name.startswith("moe_") else []
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError) as exc:
                parse_args(moe + [f"{flag}={bad}"])
            message = str(exc.value)
            assert message.startswith(flag) and "finite number" in message and "\n" not in message, \
                (flag, bad, message)
    with pytest.raises(ConfigError, match="^--lr must be a finite number, got nan$"):
        parse_args(["--config", _recipe(tmp_path, "optim:\n  lr: .nan\n")])


@pytest.mark.parametrize("argv,match", [
    (["--adam-beta1", "2"], "--adam-beta1 and --adam-beta2 must be in \\[0, 1\\), got 2.0 and 0.95"),
    (["--adam-beta2", "1"], "--adam-beta1 and --adam-beta2 must be in \\[0, 1\\)"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--rope-base", "-1"], "--rope-base must be > 0"),
    (["--init-std", "-0.02"], "--init-std and --norm-eps must be >= 0"),
    (["--bucket-size-mb", "0"], "--bucket-size-mb must be > 0, got 0.0"),
    (["--timeout-s", "0"], "--timeout-s must be > 0"),
    (["--peak-tflops", "-1"], "--peak-tflops must be > 0"),
    (["--min-loss-scale", "0"], "--min-loss-scale must be in \\(0, --initial-loss-scale 1024\\], got 0"),
    (["--initial-loss-scale", "0.5"], "--min-loss-scale must be in \\(0, --initial-loss-scale 0.5\\], got 1"),
])
def test_float_flags_out_of_their_range_are_one_line(argv, match):
    """Values that used to pass the parse and fail later: a torch error naming AdamW's internals,
    a traceback from the RoPE table, a GradReducer or DynamicLossScaler message, a negative MFU."""
    with pytest.raises(ConfigError, match="^" + match):
        parse_args(argv)


def _real_options() -> set[str]:
    from engine.config.cli import build_parser
    return {o for a in build_parser()._actions for o in a.option_strings}


def test_megatron_answers_are_for_flags_that_do_not_exist_and_name_only_flags_that_do():
    """An answer for a flag that has since become real (``--distributed-backend``) would never be
    shown and contradicts the flag; an answer naming a flag that is not there sends the user to
    another refusal."""
    import re
    from engine.config.flags import CHOICE_ANSWERS, FLAGS, MEGATRON_ANSWERS
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
