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


def test_an_empty_load_or_save_clears_the_recipes(tmp_path):
    """``--load=`` clears a recipe's checkpoint (nothing read) instead of naming the path '';
    ``--save=`` saves nothing, not even under --run-dir."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("load: /ckpt/a\nsave: /ckpt/b\nrun_dir: /runs/x\n")
    cfg = parse_args(["--config", str(recipe), "--load=", "--save="])
    assert cfg.checkpoint.load is None and not cfg.checkpoint.save
    with pytest.raises(ConfigError, match="--finetune reads the checkpoint given by --load"):
        parse_args(["--config", str(recipe), "--load=", "--finetune"])


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
    from engine.config.megatron_answers import MEGATRON_ANSWERS
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


def test_seed_is_checked_before_any_process_group():
    """numpy's generators and the dropout streams (parallel/grid/random.py) take a seed in
    [0, 2^64 / streams): a seed outside stops at start, naming --seed."""
    with pytest.raises(ConfigError, match=r"^--seed must be >= 0, got -1; give a non-negative integer"):
        parse_args(["--seed", "-1"])
    top = 2 ** 64 // 3  # 3 streams on one rank: default, replicated, split
    with pytest.raises(ConfigError, match=f"^--seed {top} is too large for 3 random streams; use a "
                                          f"seed below {top}$"):
        validate_run(parse_args(["--seed", str(top)]), LaunchEnv())
    validate_run(parse_args(["--seed", str(top - 1)]), LaunchEnv())
    with pytest.raises(ConfigError, match="too large for 12 random streams"):  # 3 x tp 2 x pp 2
        validate_run(parse_args(["--seed", str(top // 4 + 1), "--tp", "2", "--pp", "2"]),
                     LaunchEnv(0, 4, 0, 4))


def test_none_clears_a_recipes_optional_setting(tmp_path):
    """An optional setting a recipe gave is cleared on the command line with ``none`` (the
    recipe's FP8 and experts back to unset, then fp32 is accepted); a choice flag offers it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision: bf16\nfp8_format: e4m3\nnum_experts: 4\npeak_tflops: 2.0\n")
    cfg = parse_args(["--config", str(recipe), "--fp8-format", "none", "--num-experts", "none",
                      "--peak-tflops", "None", "--precision", "fp32"])
    assert (cfg.precision.fp8_format, cfg.model.num_experts, cfg.log.peak_tflops) == (None, None, None)
    kept = parse_args(["--config", str(recipe)])
    assert (kept.precision.fp8_format, kept.model.num_experts) == ("e4m3", 4)
    with pytest.raises(ConfigError, match=r"invalid choice: 'bogus' \(choose from 'e4m3', "
                                          r"'hybrid', 'none'\)"):
        parse_args(["--fp8-format", "bogus"])
    with pytest.raises(ConfigError, match="invalid int value: 'x'"):
        parse_args(["--num-experts", "x"])
