"""The side tools answer bad input before doing any work: one line on stderr, a non-zero exit, no
traceback, and no file changed (every file and directory of the workspace compared before and after).
engine.export, engine.data prepare, engine.import_hf, engine.generate and engine.checkpoint inspect:
missing and wrong-kind paths, outputs that already hold something (refused unless --overwrite),
damaged checkpoints, truncated safetensors, malformed config.json, negative counts and temperatures,
abbreviated flags. Then --overwrite does replace, and a tokenizer a tool suggests works."""
import json
import os
import shutil

import pytest
import torch

from engine.checkpoint import main as checkpoint_main
from engine.checkpoint.export import main as export_main
from engine.checkpoint.import_hf import main as import_main
from engine.config.cli import parse_args
from engine.data.__main__ import main as data_main
from engine.data.prepare import prepare
from engine.tools.generate import main as generate_main
from engine.training.trainer import Trainer
from tests.helpers.files import tree_digests

TINY = ["--mock-data", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "1"]


def _edit_json(path: str, change) -> None:
    with open(path) as fh:
        data = json.load(fh)
    change(data)
    with open(path, "w") as fh:
        json.dump(data, fh)


def _truncate(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace: a trained checkpoint and its damaged copies, its Hugging Face export and
    broken variants of it, prepared data, text inputs, a plain file."""
    root = str(tmp_path_factory.mktemp("tools"))
    p = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    trainer = Trainer(parse_args(TINY + ["--vocab-size", "300", "--save", p("ck")]))
    trainer.train()
    trainer.close()
    it = p("ck", "iter_0000001")
    for name, damage in (
            ("ck_step", lambda d: _edit_json(os.path.join(d, "index.json"), lambda i: i.update(step="x"))),
            ("ck_layout", lambda d: _edit_json(os.path.join(d, "index.json"),
                                               lambda i: i["layout"].pop("tp"))),
            ("ck_trunc", lambda d: _truncate(os.path.join(d, "rank_00000.safetensors")))):
        shutil.copytree(it, p(name))
        damage(p(name))
    assert export_main(["--load", p("ck"), "--out", p("hf")]) == 0
    cfg = lambda name, change: (shutil.copytree(p("hf"), p(name)),  # noqa: E731
                                _edit_json(p(name, "config.json"), change))
    cfg("hf_noembd", lambda c: c.pop("n_embd"))
    cfg("hf_layers", lambda c: c.update(n_layer=3))
    cfg("hf_inner", lambda c: c.update(n_inner=128))
    cfg("hf_text", lambda c: c.update(n_head="four"))
    cfg("hf_bert", lambda c: c.update(model_type="bert"))
    shutil.copytree(p("hf"), p("hf_trunc"))
    _truncate(p("hf_trunc", "model.safetensors"))
    shutil.copytree(p("hf"), p("hf_json"))
    with open(p("hf_json", "config.json"), "w") as fh:
        fh.write('{"model_type": "gpt2", ')
    shutil.copytree(p("hf"), p("hf_list"))
    with open(p("hf_list", "config.json"), "w") as fh:
        fh.write('["gpt2"]')
    os.makedirs(p("hf_empty"))
    with open(p("text.txt"), "w") as fh:
        fh.write("def add(a, b):\n    return a + b\n" * 20)
    with open(p("bad.jsonl"), "w") as fh:
        fh.write('{"text": "one"}\n{"text": "tw\n')
    prepare([p("text.txt")], p("data", "corpus"), "byte")
    with open(p("afile"), "w") as fh:
        fh.write("not a directory")
    os.makedirs(p("tok"))
    with open(p("tok", "tokenizer.json"), "w") as fh:
        fh.write("{not json")
    return root


TOOLS = {"export": export_main, "data": data_main, "import_hf": import_main, "generate": generate_main,
         "checkpoint": checkpoint_main}
GEN = ["--load", "{ck}", "--prompt", "hi"]

# (tool, arguments ({name} is a path in the workspace), exit code, what the one line says)
CASES = [
    ("export", ["--load", "{missing}", "--out", "{new}"], 2, "{missing} does not exist"),
    ("export", ["--load", "{afile}", "--out", "{new}"], 2,
     "{afile} is a file, not a checkpoint directory"),
    ("export", ["--load", "{ck}", "--out", "{hf}"], 2, "--out {hf} is not empty (it holds config.json, "
                                                       "model.safetensors): choose a new directory, or "
                                                       "add --overwrite"),
    ("export", ["--load", "{ck}", "--out", "{afile}"], 2, "--out {afile} is a file: give a directory"),
    ("export", ["--load", "{ck}", "--out", "{afile}/hf"], 2, "{afile} is a file, not a directory"),
    ("export", ["--load", "{ck}", "--out", "{ck}"], 2, "is the checkpoint's own directory"),
    ("export", ["--load", "{ck_step}", "--out", "{new}"], 2, "index.json is damaged: its step is 'x'"),
    ("export", ["--load", "{ck_layout}", "--out", "{new}"], 2, "layout.tp is None, not a positive integer"),
    ("export", ["--load", "{ck_trunc}", "--out", "{new}"], 2, "rank_00000.safetensors is truncated"),
    ("export", ["--load", "{ck}", "--out", "{new}", "--to", "onnx"], 2, "invalid choice: 'onnx'"),
    ("export", ["--load", "{ck}", "--out", "{new}", "--overw"], 2, "unrecognized arguments: --overw"),
    ("data", ["prepare", "--input", "{missing}", "--output", "{new}/corpus"], 2, "does not exist"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{data}/corpus", "--tokenizer", "byte"], 2,
     "--output {data}/corpus already holds prepared data ({data}/corpus.bin, {data}/corpus.idx, "
     "{data}/corpus.json): choose another prefix, or add --overwrite to replace it"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{data}"], 2, "--output '{data}' is a directory"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{afile}/x"], 2,
     "{afile} is a file, not a directory"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{new}/c", "--max-bytes", "-1"], 2,
     "--max-bytes must be at least 1, got -1"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{new}/c", "--train-chars", "0"], 2,
     "--train-chars must be at least 1"),
    ("data", ["prepare", "--input", "{bad.jsonl}", "--output", "{new}/c", "--tokenizer", "byte",
              "--no-progress"], 2,
     "bad.jsonl:2: not a JSON line"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{new}/c", "--tokenizer-model", "{missing}"],
     2, "{missing}"),
    ("data", ["prepare", "--input", "{text.txt}", "--output", "{new}/c", "--no-prog"], 2,
     "unrecognized arguments: --no-prog"),
    ("data", ["prep", "--input", "{text.txt}"], 2, "invalid choice: 'prep'"),
    ("import_hf", ["--load", "{missing}", "--save", "{new}"], 2, "--load {missing} does not exist"),
    ("import_hf", ["--load", "{afile}", "--save", "{new}"], 2, "--load {afile} is a file"),
    ("import_hf", ["--load", "{hf_empty}", "--save", "{new}"], 2, "{hf_empty} has no config.json"),
    ("import_hf", ["--load", "{hf_json}", "--save", "{new}"], 2, "config.json is not valid JSON"),
    ("import_hf", ["--load", "{hf_list}", "--save", "{new}"], 2, "config.json holds a JSON list"),
    ("import_hf", ["--load", "{hf_noembd}", "--save", "{new}"], 2, "config.json: n_embd is missing"),
    ("import_hf", ["--load", "{hf_text}", "--save", "{new}"], 2,
     "config.json: n_head is 'four', not a positive integer"),
    ("import_hf", ["--load", "{hf_bert}", "--save", "{new}"], 2, "model_type 'bert' is not supported"),
    ("import_hf", ["--load", "{hf_trunc}", "--save", "{new}"], 2,
     "model.safetensors is not a readable safetensors file"),
    ("import_hf", ["--load", "{hf_layers}", "--save", "{new}"], 2,
     "weight 'h.2.attn.c_attn.weight' is missing"),
    ("import_hf", ["--load", "{hf_inner}", "--save", "{new}"], 2,
     "the weights do not fit config.json"),
    ("import_hf", ["--load", "{hf}", "--save", "{ck}"], 2,
     "--save {ck} is not empty (it holds iter_0000001, latest): choose a new directory, or add --overwrite"),
    ("import_hf", ["--load", "{hf}", "--save", "{afile}"], 2, "--save {afile} is a file"),
    ("import_hf", ["--load", "{hf}", "--save", "{hf}", "--overwrite"], 2, "is the --load directory itself"),
    ("import_hf", ["--load", "{hf}", "--save", "{new}", "--overw"], 2, "unrecognized arguments: --overw"),
    ("generate", GEN + ["--max-new-tokens", "-5"], 2, "--max-new-tokens must be at least 1, got -5"),
    ("generate", GEN + ["--temperature", "-1"], 2, "--temperature must be 0 (greedy) or a positive number"),
    ("generate", GEN + ["--temperature", "nan"], 2, "--temperature must be 0 (greedy) or a positive"),
    ("generate", GEN + ["--top-k", "-3"], 2, "--top-k must be 0 (no cut) or positive, got -3"),
    ("generate", GEN + ["--tokenizer", "byte", "--seed", str(2 ** 64)], 2,
     f"--seed must be an integer in [-2**63, 2**64), got {2 ** 64}"),
    ("generate", GEN + ["--tokenizer", "byte", "--seed", str(-2 ** 63 - 1)], 2,
     "--seed must be an integer in [-2**63, 2**64)"),
    ("generate", ["--load", "{ck}", "--prompt", ""], 2, "--prompt is empty"),
    ("generate", GEN + ["--max-new-tokens", "ten"], 2, "invalid int value: 'ten'"),
    ("generate", GEN + ["--max-new", "3"], 2, "unrecognized arguments: --max-new 3"),
    ("generate", ["--load", "{missing}", "--prompt", "hi"], 2, "{missing} does not exist"),
    ("generate", ["--load", "{afile}", "--prompt", "hi"], 2, "is a file, not a checkpoint directory"),
    ("generate", ["--load", "{ck_step}", "--prompt", "hi"], 2, "its step is 'x'"),
    ("generate", ["--load", "{ck_trunc}", "--prompt", "hi", "--tokenizer", "byte"], 2, "is truncated"),
    ("generate", GEN, 2, "has no tokenizer (it was trained on mock data): pass --tokenizer PREFIX (data "
                         "prepared with a 300-token tokenizer) or --tokenizer-model (a tokenizer of 300 "
                         "tokens)"),
    ("generate", GEN + ["--tokenizer", "{missing}"], 2, "--tokenizer {missing} cannot be loaded (no "
                                                        "tokenizer found"),
    ("generate", GEN + ["--tokenizer-model", "{tok}"], 2, "--tokenizer-model {tok} cannot be loaded"),
    ("generate", GEN + ["--tokenizer", "byte", "--tokenizer-model", "{tok}"], 2,
     "--tokenizer and --tokenizer-model both name a tokenizer"),
    ("generate", GEN + ["--tokenizer", "byte", "--device", "cuda"], 2,
     "--device cuda, but this torch"),
    ("generate", GEN + ["--dtype", "fp8"], 2, "argument --dtype: invalid choice: 'fp8'"),
    ("checkpoint", ["inspect", "{missing}"], 1, "{missing} does not exist"),
    ("checkpoint", ["inspect", "{afile}"], 1, "is a file, not a checkpoint directory"),
    ("checkpoint", ["inspect", "{ck_step}"], 1, "index.json is damaged: its step is 'x', not a number of "
                                                "optimizer steps"),
    ("checkpoint", ["inspect", "{ck_layout}"], 1, "layout.tp is None"),
    ("checkpoint", ["insp", "{ck}"], 2, "invalid choice: 'insp'"),
    ("checkpoint", [], 2, "the following arguments are required: command"),
]


def _fill(text: str, root: str) -> str:
    names = ["missing", "new", "afile", "ck_step", "ck_layout", "ck_trunc", "ck", "hf_empty", "hf_json",
             "hf_list", "hf_noembd", "hf_text", "hf_bert", "hf_trunc", "hf_layers", "hf_inner", "hf",
             "text.txt", "bad.jsonl", "data", "tok"]
    for name in names:
        text = text.replace("{" + name + "}", os.path.join(root, name))
    return text


@pytest.mark.parametrize("tool,argv,code,says", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_changes_nothing(ws, capsys, tool, argv, code, says):
    before = tree_digests(ws)
    capsys.readouterr()
    assert TOOLS[tool]([_fill(a, ws) for a in argv]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gridtron: "), err
    assert _fill(says, ws) in lines[0]
    assert tree_digests(ws) == before


def test_inspect_reports_damaged_files_and_fails(ws, capsys):
    assert checkpoint_main(["inspect", os.path.join(ws, "ck_trunc")]) == 1
    out = capsys.readouterr()
    assert "DAMAGED: rank_00000.safetensors is truncated" in out.out and out.err == ""
    assert "all files verified" not in out.out


def test_overwrite_replaces_what_is_there(ws, tmp_path, capsys):
    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    shutil.copytree(os.path.join(ws, "ck"), ck, symlinks=True)
    shutil.copytree(os.path.join(ws, "hf"), hf)
    with open(os.path.join(hf, "tokenizer.json"), "w") as fh:  # an earlier export's tokenizer
        fh.write("{}")
    assert export_main(["--load", ck, "--out", hf, "--overwrite"]) == 0
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]  # no stale tokenizer
    # the import replaces the training checkpoints (its iter_0000000 is what latest names)
    assert import_main(["--load", hf, "--save", ck, "--overwrite"]) == 0
    assert sorted(os.listdir(ck)) == ["iter_0000000", "latest"]
    assert os.readlink(os.path.join(ck, "latest")) == "iter_0000000"
    prefix = str(tmp_path / "corpus")
    text = os.path.join(ws, "text.txt")
    assert data_main(["prepare", "--input", text, "--output", prefix, "--tokenizer", "byte"]) == 0
    assert data_main(["prepare", "--input", text, "--output", prefix, "--tokenizer", "bpe:300"]) == 2
    assert data_main(["prepare", "--input", text, "--output", prefix, "--tokenizer", "bpe:300",
                      "--overwrite", "--no-progress"]) == 0
    assert json.load(open(f"{prefix}.json"))["tokenizer"] == "bpe:300"
    assert os.path.isfile(f"{prefix}.tokenizer.json")
    capsys.readouterr()


def test_a_suggested_tokenizer_works(ws, tmp_path, capsys):
    """--tokenizer byte is suggested only for the byte tokenizer's own 257 tokens, and then works;
    a smaller tokenizer than the model's vocabulary never receives an id it cannot decode."""
    assert generate_main(["--load", os.path.join(ws, "ck"), "--prompt", "hi", "--tokenizer", "byte",
                          "--max-new-tokens", "64", "--temperature", "50", "--top-k", "0"]) == 0
    save = str(tmp_path / "ck")
    trainer = Trainer(parse_args(TINY + ["--vocab-size", "257", "--save", save]))
    trainer.train()
    trainer.close()
    capsys.readouterr()
    assert generate_main(["--load", save, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "pass --tokenizer byte, --tokenizer PREFIX" in err
    assert generate_main(["--load", save, "--prompt", "hi", "--tokenizer", "byte",
                          "--max-new-tokens", "4"]) == 0
    assert "sample from" in capsys.readouterr().out


def test_a_tiny_temperature_samples_the_greedy_token(ws, capsys):
    """Any temperature > 0 samples: the logits are shifted by their maximum before the division,
    so 1e-45 (which overflowed them to inf, and torch.multinomial refused the nan probabilities)
    gives the greedy token, with or without the top-k cut; the command line too."""
    from engine.tools.generate import generate_ids, load_model
    model, _, _ = load_model(os.path.join(ws, "ck"))
    prompt = list(b"hello")
    greedy = generate_ids(model, prompt, 6, temperature=0)
    for temperature in (1e-45, 1e-30, 5e-324):
        for top_k in (0, 40):
            assert generate_ids(model, prompt, 6, temperature=temperature, top_k=top_k,
                                seed=3) == greedy, (temperature, top_k)
    capsys.readouterr()
    assert generate_main(["--load", os.path.join(ws, "ck"), "--prompt", "hello", "--tokenizer",
                          "byte", "--temperature", "1e-45", "--max-new-tokens", "4"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_generate_runs_in_the_dtype_asked_for(ws, capsys):
    """--dtype casts the loaded weights as --precision does in training (the checkpoint's fp32
    values rounded once); the sample line names the dtype and the device."""
    from engine.tools.generate import load_model
    full, _, _ = load_model(os.path.join(ws, "ck"))
    half, _, _ = load_model(os.path.join(ws, "ck"), dtype=torch.bfloat16)
    pairs = list(zip(full.state_dict().items(), half.state_dict().items()))
    assert pairs and all(b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b)
                         for (_, a), (_, b) in pairs if a.is_floating_point())
    assert generate_main(["--load", os.path.join(ws, "ck"), "--prompt", "hi", "--tokenizer", "byte",
                          "--dtype", "bf16", "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert "(step 1, bfloat16 on cpu) ---" in capsys.readouterr().out
    assert generate_main(["--load", os.path.join(ws, "ck"), "--prompt", "hi", "--tokenizer", "byte",
                          "--max-new-tokens", "2"]) == 0
    assert "(step 1, float32 on cpu) ---" in capsys.readouterr().out    # auto on the CPU


ALL_TOOLS = {  # every command line, and a mistake in its arguments
    "train": ("engine.training.launch", ["--bogus"]),
    "data": ("engine.data.__main__", ["prepare", "--input", "x", "--output", "y", "--bogus"]),
    "import_hf": ("engine.checkpoint.import_hf", ["--load", "x", "--save", "y", "--bogus"]),
    "export": ("engine.checkpoint.export", ["--load", "x", "--out", "y", "--bogus"]),
    "generate": ("engine.tools.generate", ["--load", "x", "--prompt", "hi", "--bogus"]),
    "plan": ("engine.tools.plan_cli", ["--bogus"]),
    "dryrun": ("engine.dryrun.cli", ["--world-size", "1", "--bogus"]),
    "preflight": ("engine.tools.preflight", ["--bogus"]),
}


@pytest.mark.parametrize("tool", sorted(ALL_TOOLS))
def test_every_tool_says_a_mistake_the_same_way(tool, capsys):
    """One exit code (2) and one prefix (``gridtron: ``) for a user's mistake, in every tool."""
    import importlib
    module, argv = ALL_TOOLS[tool]
    capsys.readouterr()
    assert importlib.import_module(module).main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gridtron: ") and "--bogus" in lines[0], out.err
    assert out.out == "" and "Traceback" not in out.err


def test_generate_takes_the_chips_dtype_and_fused_ops(ws, capsys, monkeypatch):
    """generate asks the chip as the trainer does: --dtype auto is bf16 only where the chip has it
    (fp16 on an Ascend 910A, a V100 or a T4), bf16 asked on a 910A is one line, and the model is
    built with the chip's fused ops (DeviceInfo.kernel_paths; on a 910A without
    npu_fusion_attention and npu_swiglu)."""
    from engine.device.chips import npu_kernel_paths
    from engine.device.runtime import DeviceInfo
    from engine.tools import generate
    cpu = torch.device("cpu")

    def dev(kind, name, capability=None, paths=None):
        return DeviceInfo(kind, cpu, "gloo", name, capability=capability,
                          **({"kernel_paths": paths} if paths else {}))
    picks = {(k, n, c): generate.run_dtype("auto", dev(k, n, c)) for k, n, c in (
        ("cpu", "cpu", None), ("npu", "Ascend910A", None), ("npu", "Ascend910B3", None),
        ("cuda", "Tesla V100-SXM2-32GB", (7, 0)), ("cuda", "Tesla T4", (7, 5)),
        ("cuda", "NVIDIA H100 80GB HBM3", (9, 0)))}
    assert list(picks.values()) == [torch.float32, torch.float16, torch.bfloat16, torch.float16,
                                    torch.float16, torch.bfloat16]
    with pytest.raises(ValueError, match="^--dtype bf16: Ascend910A has no bfloat16 arithmetic"):
        generate.run_dtype("bf16", dev("npu", "Ascend910A"))
    paths = npu_kernel_paths("Ascend910A")[0]
    assert not paths.fusion_attention and not paths.swiglu
    model, _, _ = generate.load_model(os.path.join(ws, "ck"), paths=paths)
    assert {m.paths for m in model.modules() if hasattr(m, "paths")} == {paths}
    seen = []
    real = generate.load_model
    monkeypatch.setattr(generate, "setup_device", lambda kind: dev("cpu", "cpu", paths=paths))
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: seen.append(k["paths"]) or real(*a, **k))
    assert generate_main(["--load", os.path.join(ws, "ck"), "--prompt", "hi", "--tokenizer", "byte",
                          "--max-new-tokens", "2"]) == 0
    assert seen == [paths]
