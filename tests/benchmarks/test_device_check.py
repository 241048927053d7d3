"""benchmarks/device_check.py on a machine without an accelerator: a clear "nothing to check", and
the parts that run anywhere (the kernel comparison on CPU, the 1.3B recipe's flags and size)."""
from __future__ import annotations

import torch

from benchmarks import device_check
from engine.config.cli import parse_args


def test_without_an_accelerator_there_is_nothing_to_check(capsys, monkeypatch):
    monkeypatch.setattr(device_check, "detect_device_type", lambda requested="auto": "cpu")
    assert device_check.main([]) == 0
    assert "no accelerator (CUDA or Ascend NPU) found: nothing to check" in capsys.readouterr().out


def test_kernel_comparison_runs_on_cpu():
    rows = device_check.check_kernels(torch.device("cpu"), torch.float32, seq=64)
    assert [r["op"].split(" ")[0] for r in rows] == ["attention"] * 3 + ["layer_norm", "rms_norm",
                                                                      "rope", "swiglu"]
    assert all(r["ok"] for r in rows), rows


def test_training_recipe_is_the_13b_gpt():
    from models import GPTChunk, LayerContext
    from parallel.state import ParallelState
    from parallel.tensor_parallel import Initializer
    cfg = parse_args(device_check.train_argv("cuda", 20, "m.jsonl", "runs/x", compile_=True))
    assert cfg.compile and cfg.precision.precision == "bf16" and cfg.device == "cuda"
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (24, 2048, 16, 2048)
    with torch.device("meta"):
        model = GPTChunk(m, ParallelState.serial("meta"), LayerContext(Initializer(1, 0.02)),
                         range(m.num_layers))
    params = sum(p.numel() for p in model.parameters())
    assert 1.25e9 < params < 1.45e9, params


def test_training_run_and_its_summary_on_cpu(tmp_path):
    """The launch-and-summarise path, with a tiny model in place of the 1.3B one."""
    tiny = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
            "vocab-size": 256}
    row = device_check.run_training("cpu", 3, 1, tmp_path, False, 120, micro_batch=2,
                                    global_batch=4, model=tiny, precision="fp32")
    assert row["run"] == "eager" and row["steps"] == 2 and row["warmup"] == 1
    assert row["tokens"] == 2 * 4 * 32 and row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert row["peak_memory_bytes"] > 0
