"""The hardware a run is for, checked on the CPU: the chip table's choices per Ascend SKU, those
choices reaching the kernels (a model on the torch_npu stand-in calls exactly the fused ops its
chip supports), the overflow decision on saturation-mode chips, device binding from the visible
devices, the TF32/HF32 switch, and the MFU peak of the precision actually used."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import engine.device.runtime as device_mod
import kernels
from engine.device.chips import FUSED_OPS, GENERATIONS, generation_of, npu_kernel_paths, overflow_mode
from engine.config.schema import RunConfig
from engine.device.runtime import NO_OVERFLOW_REGISTER, DeviceInfo, FloatStatusCheck, device_index, set_matmul_precision, setup_device
from engine.training.loss_scaler import DynamicLossScaler, ConstantScaler, unscale_and_check
from engine.plan.hardware import DEVICE_SPECS, lookup_device
from engine.observe.utilization import run_peak_tflops
from models import GPTChunk, GPTConfig, LayerContext
from parallel.dp import MixedPrecisionOptimizer
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.helpers.npu_fake import install_fake_npu

ALL_OPS = {"npu_fusion_attention", "npu_swiglu", "npu_rms_norm", "npu_rotary_mul", "npu_grouped_matmul"}
# SKU name as torch_npu.npu.get_device_name reports it -> (generation, fused ops it runs, overflow)
SKUS = {
    "Ascend910A": ("atlas-training", {"npu_rms_norm", "npu_rotary_mul"}, "saturation"),
    "Ascend910ProA": ("atlas-training", {"npu_rms_norm", "npu_rotary_mul"}, "saturation"),
    "Ascend910PremiumA": ("atlas-training", {"npu_rms_norm", "npu_rotary_mul"}, "saturation"),
    "Ascend910ProB": ("atlas-training", {"npu_rms_norm", "npu_rotary_mul"}, "saturation"),
    "Ascend910B1": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910B2": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910B2C": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910B3": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910B4": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910B4-1": ("atlas-a2", ALL_OPS, "inf_nan"),
    "Ascend910_9391": ("atlas-a3", ALL_OPS, "inf_nan"),
    "Ascend910_9382": ("atlas-a3", ALL_OPS, "inf_nan"),
    "Ascend910_9362": ("atlas-a3", ALL_OPS, "inf_nan"),
    "Ascend950PR_9589": ("ascend950", {"npu_fusion_attention"}, "inf_nan"),
    "Ascend950DT_9591": ("ascend950", {"npu_fusion_attention"}, "inf_nan"),
}
TORCH_NPU = {"fusion_attention": "npu_fusion_attention", "swiglu": "npu_swiglu",
             "rms_norm": "npu_rms_norm", "rotary_mul": "npu_rotary_mul",
             "grouped_matmul": "npu_grouped_matmul"}


@pytest.mark.parametrize("name", sorted(SKUS))
def test_chip_table_per_sku(name):
    generation, ops, mode = SKUS[name]
    assert generation_of(name).key == generation
    paths, notes = npu_kernel_paths(name)
    assert {TORCH_NPU[f.name] for f in dataclasses.fields(paths)
            if f.name in TORCH_NPU and getattr(paths, f.name)} == ops
    assert paths.rotary_table == ("atlas-training" if generation == "atlas-training" else "a2-a3")
    assert len(notes) == len(ALL_OPS - ops) and all(name in n for n in notes)
    assert overflow_mode(name) == mode


def test_overflow_mode_follows_the_chip_then_the_runtime():
    # a chip with one mode has that mode whatever the runtime says
    assert overflow_mode("Ascend910A", runtime_inf_nan=True) == "saturation"
    assert overflow_mode("Ascend950PR_9589", runtime_inf_nan=False) == "inf_nan"
    # A2 / A3 can be switched to saturation (INF_NAN_MODE_ENABLE=0): the runtime decides
    assert overflow_mode("Ascend910B2", runtime_inf_nan=False) == "saturation"
    assert overflow_mode("Ascend910_9392", runtime_inf_nan=True) == "inf_nan"
    # an unknown NPU: the runtime, else the safe choice (the status register sees every overflow)
    assert overflow_mode("Ascend310P3", runtime_inf_nan=True) == "inf_nan"
    assert overflow_mode("Ascend310P3") == "saturation"
    paths, notes = npu_kernel_paths("Ascend310P3")
    assert not any(getattr(paths, op) for op in TORCH_NPU) and len(notes) == 5 and "unknown NPU" in notes[0]


def test_every_ascend_sku_of_the_hardware_table_is_in_the_chip_table():
    for key in DEVICE_SPECS:
        if key.startswith("ascend") and key != "ascend910b":   # (a key without a SKU digit)
            assert generation_of(key) is not None, key
    assert lookup_device("Ascend910ProB") is None   # a 910 of another bin: no published peak
    assert set(FUSED_OPS) == {f.name for f in dataclasses.fields(kernels.KernelPaths) if isinstance(f.default, bool)}
    assert {g.key for g in GENERATIONS} >= {gen for gens in FUSED_OPS.values() for gen in gens}


def _llama_on_fake_npu(monkeypatch, chip: str | None):
    """A 1-layer llama (head_dim 128, within npu_rotary_mul's limits) forward on the stand-in;
    ``chip`` None: on the CPU paths, the reference."""
    fake = install_fake_npu(monkeypatch) if chip else None
    paths = npu_kernel_paths(chip)[0] if chip else kernels.ALL_FUSED
    cfg = GPTConfig(num_layers=1, hidden_size=256, num_attention_heads=2, seq_length=8,
                    vocab_size=64, block="llama")
    model = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(3), kernel_paths=paths),
                     range(1))
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(tokens, tokens).mean()
    return fake, loss


@pytest.mark.parametrize("chip", ["Ascend910A", "Ascend910B3", "Ascend950PR_9589"])
def test_model_calls_exactly_the_chips_fused_ops(monkeypatch, chip):
    fake, loss = _llama_on_fake_npu(monkeypatch, chip)
    called = {c.split(":")[0] for c in fake.calls}
    assert called == SKUS[chip][1] - {"npu_grouped_matmul"}, (chip, fake.calls)  # no experts
    monkeypatch.undo()                 # the CPU paths compute the same model
    _, ref = _llama_on_fake_npu(monkeypatch, None)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


class _Register:
    """The overflow check's interface (clear / flag), standing for the float status register."""

    def __init__(self, overflowed: bool):
        self.overflowed, self.cleared = overflowed, 0

    def clear(self):
        self.cleared += 1

    def flag(self):
        return torch.tensor(1.0 if self.overflowed else 0.0)


def test_saturated_overflow_skips_the_step_although_gradients_are_finite():
    """On a saturation-mode chip an fp16 overflow leaves +-65504 in the gradients; only the
    register knows. The scaler must back off and skip exactly when the register says so."""
    ps = ParallelState.serial()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = MixedPrecisionOptimizer([p], ps=ps)
    for register, skipped in ((_Register(True), True), (_Register(False), False)):
        scaler = DynamicLossScaler(init_scale=4.0, hysteresis=1)
        p.grad = torch.tensor([65504.0, -65504.0, 4.0], dtype=torch.float16)   # saturated, finite
        check = unscale_and_check(opt, scaler, overflow=register)
        assert check.skipped == skipped and scaler.scale == (2.0 if skipped else 4.0)
    # bf16/fp32 (constant scale): the register is the only overflow signal there too
    p.grad = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float16)
    assert unscale_and_check(opt, ConstantScaler(), overflow=_Register(True)).skipped
    assert not unscale_and_check(opt, ConstantScaler(), overflow=_Register(False)).skipped


def test_overflow_check_is_the_register_only_on_saturation_mode_npus():
    npu = DeviceInfo("npu", torch.device("cpu"), "hccl", "Ascend910A", overflow_mode="saturation")
    assert isinstance(npu.overflow_check(), FloatStatusCheck)
    for dev in (DeviceInfo("npu", torch.device("cpu"), "hccl", "Ascend910B2"),
                DeviceInfo("cuda", torch.device("cpu"), "nccl", "NVIDIA H100"),
                DeviceInfo("cpu", torch.device("cpu"), "gloo", "cpu")):
        assert dev.overflow_check() is NO_OVERFLOW_REGISTER
        assert NO_OVERFLOW_REGISTER.flag() is None


def test_device_binding_from_the_visible_devices(monkeypatch):
    slurm = LaunchEnv.from_env({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
                                "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (slurm.local_rank, slurm.local_world_size) == (3, 4)
    bound = []
    fake_cuda = types.SimpleNamespace(set_device=bound.append, get_device_name=lambda i: "NVIDIA H100",
                                      get_device_capability=lambda i: (9, 0),
                                      is_available=lambda: True, device_count=lambda: 1)
    monkeypatch.setattr(device_mod.torch, "cuda", fake_cuda)
    dev = setup_device("cuda", slurm.local_rank, slurm.local_world_size)   # one visible device
    assert bound == [0] and dev.device == torch.device("cuda", 0) and dev.backend == "nccl"
    assert dev.capability == (9, 0)
    fake_cuda.device_count = lambda: 4                                      # torchrun: all four
    assert setup_device("cuda", 3, 4).device.index == 3 and bound[-1] == 3
    fake_cuda.device_count = lambda: 2
    with pytest.raises(ValueError, match="share"):
        setup_device("cuda", 3, 4)
    assert device_index(6, 8, 8) == 6 and device_index(6, 8, 1) == 0
    with pytest.raises(ValueError, match="no device"):
        device_index(0, 1, 0)


def test_an_accelerator_run_refuses_a_torch_older_than_its_streams(monkeypatch, capsys):
    """The side streams need ``with torch.Stream`` (torch 2.7) and ``torch.accelerator``: on a
    GPU or NPU an older torch stops at start with one line; the CPU runs on it."""
    from engine.device.runtime import MIN_ACCELERATOR_TORCH, accelerator_torch_problem
    assert MIN_ACCELERATOR_TORCH == (2, 7)
    assert accelerator_torch_problem("cuda", "2.6.0+cu124") == (
        "--device cuda needs torch 2.7 or newer (its streams and events serve every side stream "
        "of the engine); this torch is 2.6.0+cu124: install torch >= 2.7, or use --device cpu")
    assert "torch_npu of the same version" in accelerator_torch_problem("npu", "2.5.1")
    for kind, version in (("cuda", "2.7.0"), ("npu", "2.7.1.post2"), ("cuda", "2.11.0+cu130"),
                          ("cpu", "2.4.0")):
        assert accelerator_torch_problem(kind, version) is None, (kind, version)
    # through the flags, before anything is built: the one line, no traceback
    fake_cuda = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(device_mod.torch, "cuda", fake_cuda)
    monkeypatch.setattr(device_mod.torch, "__version__", "2.6.0+cu124")
    from engine.base import ConfigError
    from engine.config.cli import parse_args
    from engine.training.validate import validate_run
    with pytest.raises(ConfigError, match=r"^--device cuda needs torch 2.7 or newer .* this torch "
                                          r"is 2.6.0\+cu124"):
        validate_run(parse_args(["--device", "cuda"]), LaunchEnv())
    monkeypatch.setattr(device_mod.torch, "__version__", "2.7.0+cu126")
    assert device_mod.detect_device_type("cuda") == "cuda"


def test_tf32_switch_and_mfu_peak_per_precision():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        assert set_matmul_precision("cuda", True) is True
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert set_matmul_precision("cuda", False) is False
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert set_matmul_precision("cpu", True) is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before

    def peak(device, name, precision, tf32, override=None):
        return run_peak_tflops(types.SimpleNamespace(type=device, name=name), precision, override,
                               tf32)

    from engine.config.cli import parse_args
    assert parse_args(["--allow-tf32"]).precision.allow_tf32 and not RunConfig().precision.allow_tf32
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak("cuda", h100, "bf16", False) == 989.0
    assert peak("cuda", h100, "fp32", False) == 67.0       # no TF32: the plain fp32 peak
    assert peak("cuda", h100, "fp32", True) == 494.7       # --allow-tf32
    assert peak("npu", "Ascend910B2", "bf16", False) == DEVICE_SPECS["ascend910b2"].peak_tflops
    assert peak("npu", "Ascend910B2", "fp32", True) is None  # no published HF32 peak: MFU null
    assert peak("cuda", h100, "fp32", False, override=50.0) == 50.0


def test_rope_tables_are_built_once_and_equal_the_uncached_ones():
    cache = kernels.RopeCache()
    cos, sin = cache.table(12, 16, 10000.0, torch.bfloat16)
    ref = kernels.rope_cos_sin(12, 16, 10000.0, None, torch.bfloat16)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    short = cache.table(5, 16, 10000.0, torch.bfloat16)          # served by the longer table
    assert torch.equal(short[0], ref[0][:5]) and cache.builds == 1
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 0]])
    at = cache.at(positions, 16, 10000.0, torch.float32, length=12)
    want = kernels.rope_cos_sin_at(positions, 16, 10000.0, torch.float32)
    assert torch.equal(at[0], want[0]) and torch.equal(at[1], want[1])
    assert cache.at(positions, 16, 10000.0, torch.float32, length=12) is at   # same micro-batch
    cache.table(12, 16, 10000.0, torch.float32)
    assert cache.builds == 2                                       # one per (dim, base, dtype, device)


def test_a_model_builds_one_rope_table_and_one_npu_mask(monkeypatch):
    install_fake_npu(monkeypatch)
    cfg = GPTConfig(num_layers=3, hidden_size=256, num_attention_heads=2, seq_length=8,
                    vocab_size=64, block="llama")
    ctx = LayerContext(Initializer(3))
    model = GPTChunk(cfg, ParallelState.serial(), ctx, range(3))
    gets = []
    real_get = ctx.mask_cache.get
    monkeypatch.setattr(ctx.mask_cache, "get", lambda device: gets.append(device) or real_get(device))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):                                          # two micro-batches, no inputs
            model(torch.randint(0, 64, (1, 8), generator=g))
    assert ctx.rope_cache.builds == 1 and len(ctx.mask_cache) == 1 and len(gets) == 6


def test_docstring_examples():
    import doctest

    import engine.device.chips
    import engine.plan.memory
    import parallel.pipeline.p2p
    for module in (engine.device.chips, device_mod, parallel.pipeline.p2p, engine.plan.memory):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.parametrize("name", sorted(SKUS))
def test_bf16_only_where_the_chip_has_it(name):
    from engine.device.chips import precision_problem
    problem = precision_problem(name, "bf16")
    assert (problem is not None) == (SKUS[name][0] == "atlas-training")
    assert precision_problem(name, "fp16") is None and precision_problem(name, "fp32") is None
    if problem:
        assert name in problem and "--precision fp16" in problem and "\n" not in problem


def test_bf16_on_a_910a_stops_at_start_with_one_line(monkeypatch, capsys):
    """engine.train on an Ascend 910A: the device setup (there is no NPU here) returns what the
    device module reports for that chip; the run stops before any process group, exit 2."""
    import engine.training.trainer as trainer_mod
    from engine.training.launch import main
    made = []
    monkeypatch.setattr(trainer_mod, "setup_device", lambda *a, **k: DeviceInfo(
        "npu", torch.device("cpu"), "hccl", "Ascend910A", *npu_kernel_paths("Ascend910A")[:1]))
    monkeypatch.setattr(trainer_mod.ParallelState, "initialize", lambda *a, **k: made.append(1))
    code = main(["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
                 "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--train-iters", "1", "--precision", "bf16", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and made == []
    assert err == ["gridtron: configuration error: --precision bf16 needs bfloat16 arithmetic, which "
                   "Ascend910A (Atlas training series) does not have: use --precision fp16 (the dynamic "
                   "loss scaler keeps it stable) or fp32"]


def test_compile_on_npu_stops_at_start_with_one_line(monkeypatch, capsys):
    """TorchAir is documented for inference graphs only: --compile on an NPU stops before any
    process group, exit 2, one line; the same run without --compile gets past the check."""
    import engine.training.trainer as trainer_mod
    from engine.training.launch import main
    made = []
    monkeypatch.setattr(trainer_mod, "setup_device", lambda *a, **k: DeviceInfo(
        "npu", torch.device("cpu"), "hccl", "Ascend910B2", *npu_kernel_paths("Ascend910B2")[:1]))

    def initialize(*a, **k):
        made.append(1)
        raise SystemExit(7)  # past the start-up checks: stop here

    monkeypatch.setattr(trainer_mod.ParallelState, "initialize", initialize)
    monkeypatch.setattr(trainer_mod, "set_matmul_precision", lambda *a: False)  # no torch_npu here
    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--precision", "bf16", "--no-progress"]
    code = main([*argv, "--compile"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and made == []
    assert len(err) == 1 and err[0].startswith("gridtron: configuration error: --compile on NPU: ")
    with pytest.raises(SystemExit):
        main(argv)
    assert made == [1]


class _TorchNpuOps:
    """A torch_npu with the float-status op pair: an 8-word register the 'kernels' set."""

    def __init__(self):
        self.register = torch.zeros(8)
        self.calls = []

    def npu_clear_float_status(self, buf):
        self.calls.append("clear")
        self.register.zero_()
        return buf.zero_()

    def npu_get_float_status(self, buf):
        self.calls.append("get")
        return self.register.to(torch.int32)


class _TorchNpuWrappers:
    """A torch_npu without the op pair, only torch_npu.npu.utils' public wrappers."""

    def __init__(self):
        self.overflowed = False
        utils = types.SimpleNamespace(npu_check_overflow=self._check,
                                      clear_npu_overflow_flag=self._clear)
        self.npu = types.SimpleNamespace(utils=utils)

    def _check(self, grad):
        assert grad == 0.0  # ignored in saturation mode
        hit, self.overflowed = self.overflowed, False  # the wrapper clears what it reports
        return hit

    def _clear(self):
        self.overflowed = False


def test_float_status_check_probes_the_installed_torch_npu():
    ops = _TorchNpuOps()
    check = FloatStatusCheck(torch.device("cpu"), torch_npu=ops)
    check.clear()
    assert check.api == "npu_get_float_status" and check.flag().item() == 0.0
    ops.register[3] = 1.0  # a kernel overflowed
    flag = check.flag()
    assert flag.shape == () and flag.item() == 1.0 and ops.calls == ["clear", "get", "get"]
    check.clear()
    assert check.flag().item() == 0.0

    wrappers = _TorchNpuWrappers()
    check = FloatStatusCheck(torch.device("cpu"), torch_npu=wrappers)
    check.clear()
    assert check.api == "npu_check_overflow" and check.flag().item() == 0.0
    wrappers.overflowed = True
    assert check.flag().item() == 1.0 and check.flag().item() == 0.0


@pytest.mark.parametrize("kind,name,capability,ok", [
    ("cuda", "NVIDIA H100 80GB HBM3", (9, 0), True), ("cuda", "NVIDIA H200", (9, 0), True),
    ("cuda", "NVIDIA H100 NVL", None, True), ("cuda", "NVIDIA L40S", (8, 9), True),
    ("cuda", "NVIDIA GeForce RTX 4090", (8, 9), True), ("cuda", "NVIDIA B200", (10, 0), True),
    ("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), False), ("cuda", "NVIDIA A10G", (8, 6), False),
    ("cuda", "Tesla V100-SXM2-32GB", (7, 0), False), ("cuda", "Tesla T4", (7, 5), False),
    ("cuda", "NVIDIA Future GPU", (10, 0), False),       # not in the table: unknown, refused
    ("cuda", "NVIDIA H100 80GB HBM3", (8, 0), False),    # the device says otherwise: refused
    ("cpu", "cpu", None, True)] + [("npu", name, None, False) for name in sorted(SKUS)])
def test_fp8_only_where_the_chip_has_it(kind, name, capability, ok):
    """--fp8-format needs compute capability 8.9 or later (or the CPU's torch._scaled_mm); every
    Ascend chip is refused, the 950 naming its HiF8; the line names the chip."""
    from engine.device.chips import fp8_problem
    problem = fp8_problem(kind, name, capability)
    assert (problem is None) == ok, problem
    if problem is not None:
        assert problem.startswith("--fp8-format") and name in problem and "\n" not in problem
        if kind == "npu" and name.startswith("Ascend950"):
            assert "HiF8" in problem and "not support" in problem
