"""Hugging Face grouped-query-attention Llama, Mixtral and Qwen3-MoE in and out.

Tiny random models (2 layers, hidden 64, 4 heads in 2 key/value groups, 4 experts of which 2 per
token, vocabulary 128) are built by transformers and saved with save_pretrained, then imported
with ``engine.import_hf``. For each: (a) the imported model's logits equal transformers' in fp32,
(b) greedy generation picks transformers' tokens, (c) ``engine.export --to hf`` writes back
exactly the tensors (names and values) transformers saved, and transformers loads the export;
transformers 5's fused in-memory expert tensors import as the per-expert ones it saves.
Qwen3-MoE is imported both with ``norm_topk_prob`` false (``--moe-router-pre-softmax``) and true
(the default router), its first layer dense (``mlp_only_layers``). (d) The imported MoE
checkpoints load under ep 2 (dp 2, one spawned group for both) and train three steps, on a corpus
prepared with the models' own tokenizer (a byte-level BPE saved beside them), with the serial run's
losses, gradient norms and balancing losses (a run's own --moe-aux-loss-coeff
over the checkpoint's). Routers the engine does not build are refused in one line.
"""
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.checkpoint.hf_moe import export_family  # noqa: E402
from engine.checkpoint.index import CheckpointError  # noqa: E402
from engine.checkpoint.import_hf import main as import_main  # noqa: E402
from engine.export import main as export_main  # noqa: E402
from engine.tools.generate import generate_ids, load_model  # noqa: E402
from parallel.grid.launch import LaunchEnv  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

VOCAB, SEQ = 320, 16
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20
        + "The quick brown fox jumps over the lazy dog. " * 30)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=96, **SHAPE)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **SHAPE)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        head_dim=16, mlp_only_layers=[0], norm_topk_prob=False, **SHAPE)),
    "qwen3_moe_norm": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        head_dim=16, norm_topk_prob=True, **SHAPE)),
}
TRAIN = ["--use-checkpoint-args", "--seq-length", str(SEQ),
         "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "3", "--precision",
         "fp32", "--lr", "1e-3", "--lr-warmup-iters", "0", "--no-progress", "--device", "cpu",
         "--peak-tflops", "1"]




@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{family: (HF dir, imported checkpoint dir)}, and "data": a corpus prepared with the
    models' own tokenizer (a byte-level BPE saved beside each model, copied by the import)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.data.__main__ import main as data_main
    root = tmp_path_factory.mktemp("hf_moe")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.add_tokens([f"<|unused{i}|>" for i in range(VOCAB - len(tok))], special_tokens=True)
    assert len(tok) == VOCAB  # the models' vocabulary: a checkpoint trains on its own tokenizer's data
    torch.manual_seed(0)
    dirs = {}
    for name, build in MODELS.items():
        model = build()
        with torch.no_grad():  # larger weights than the default init; norm weights away from 1
            for p in model.parameters():
                p.normal_(0.0, 0.2) if p.ndim >= 2 else p.uniform_(0.5, 1.5)
        path, ck = str(root / name), str(root / f"{name}_ck")
        model.save_pretrained(path)
        tok.save_pretrained(path)
        assert import_main(["--load", path, "--save", ck]) == 0
        dirs[name] = (path, ck)
    (root / "text.txt").write_text(TEXT)
    dirs["data"] = str(root / "data" / "corpus")
    assert data_main(["prepare", "--input", str(root / "text.txt"), "--output", dirs["data"],
                      "--tokenizer-model", dirs["mixtral"][0], "--no-progress"]) == 0
    return dirs


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(MODELS))
def test_import_matches_transformers_and_exports_back(hf, family, tmp_path):
    path, ck = hf[family]
    ref = hf_model(path)
    ours, index, _ = load_model(ck)
    m = index["model"]
    assert m["num_query_groups"] == 2 and m["qk_layernorm"] == family.startswith("qwen3")
    if family != "llama":
        assert (m["num_experts"], m["moe_router_topk"], m["moe_ffn_hidden_size"]) == (4, 2, 32)
        assert m["moe_router_pre_softmax"] == (family == "qwen3_moe")
        assert m["moe_layer_freq"] == ("[0,1]" if family == "qwen3_moe" else "1")
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
        got = ours(x)[..., :VOCAB]
    assert want.abs().max() > 1.0  # not a comparison of near-zero logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    prompt = x[0, :5].tolist()
    new = generate_ids(ours, prompt, max_new_tokens=10, temperature=0)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)
    assert new == theirs[0, 5:].tolist()
    out = str(tmp_path / "exported")
    assert export_main(["--load", ck, "--to", "hf", "--out", out]) == 0
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (path, out))
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == json.load(open(os.path.join(path, "config.json")))["model_type"]
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(x).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_expert_tensors_import_as_the_per_expert_ones(hf, family, tmp_path):
    """transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj`` (E, 2F, h),
    ``down_proj`` (E, h, F)); a checkpoint written from that state dict imports the same model."""
    path, ck = hf[family]
    fused = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    src = tmp_path / "fused"
    src.mkdir()
    shutil.copyfile(os.path.join(path, "config.json"), src / "config.json")
    save_file(fused, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert import_main(["--load", str(src), "--save", str(tmp_path / "ck")]) == 0
    want = dict(load_model(ck)[0].logical_named_parameters())
    got = dict(load_model(str(tmp_path / "ck"))[0].logical_named_parameters())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _train(ps, cases):
    from engine.training.launch import run_config
    from models.logical import logical_views
    from engine.training.trainer import Trainer
    out = []
    for argv in cases:
        trainer = Trainer(run_config(argv))
        records = trainer.train().records
        out.append({**{k: [r[k] for r in records] for k in ("loss", "grad_norm", "moe_aux_loss")},
                    "ep": trainer.ps.ep_group.size, "experts": sorted(
                        n for n in logical_views(trainer.chunks[0]) if ".experts." in n)})
        trainer.close()
    return out


def test_imported_moe_models_train_under_ep2_as_serially(hf):
    from engine.training.launch import run_config
    from engine.training.trainer import Trainer
    families = ("mixtral", "qwen3_moe")
    # Mixtral: --ep alone (the experts come from the checkpoint); Qwen3-MoE with a balancing loss
    # of this run's choosing (MoE flags name --num-experts too, equal to the checkpoint's)
    extra = {"mixtral": [], "qwen3_moe": ["--num-experts", "4", "--moe-router-load-balancing-type",
                                          "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]}
    refs = []
    for family in families:
        trainer = Trainer(run_config(TRAIN + ["--load", hf[family][1], "--data-path", hf["data"]]
                                     + extra[family]), launch=LaunchEnv())
        refs.append(trainer.train().records)
        trainer.close()
    assert refs[0][0]["moe_aux_loss"] == 0 and refs[1][0]["moe_aux_loss"] > 0
    cases = [TRAIN + ["--load", hf[f][1], "--data-path", hf["data"], "--dp", "2", "--ep", "2"]
             + extra[f] for f in families]
    runs = run_distributed(_train, grid=RankGrid(dp=2), args=(cases,), timeout_s=120)
    for i, family in enumerate(families):
        assert runs[0][i]["ep"] == 2
        # each EP rank holds two of each MoE layer's four experts, the other two the peer
        held = [{n.split(".experts.experts.")[1].split(".")[0] for n in r[i]["experts"]} for r in runs]
        assert held == [{"0", "1"}, {"2", "3"}], (family, held)
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            want = [r[key] for r in refs[i]]
            for step, (got, ref) in enumerate(zip(runs[0][i][key], want), start=1):
                assert abs(got - ref) <= 1e-4 * abs(ref), f"{family} ep 2: {key} at step {step}: {got} vs {ref}"
        assert refs[i][0]["loss"] != refs[i][-1]["loss"]  # it trains


def _refused(capsys, hf_dir, tmp_path) -> str:
    capsys.readouterr()
    assert import_main(["--load", str(hf_dir), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "ck" / "latest")
    return err


@pytest.mark.parametrize("field, value", [("scoring_func", "sigmoid"), ("n_group", 4),
                                          ("topk_method", "noaux_tc"), ("routed_scaling_factor", 2.5),
                                          ("norm_topk_prob", "yes")])
def test_unsupported_router_fields_are_refused_in_one_line(hf, tmp_path, capsys, field, value):
    src = tmp_path / "hf"
    shutil.copytree(hf["qwen3_moe"][0], src)
    config = json.load(open(src / "config.json"))
    json.dump({**config, field: value}, open(src / "config.json", "w"))
    assert field in _refused(capsys, src, tmp_path)


def test_a_router_bias_is_refused_in_one_line(hf, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(hf["mixtral"][0], src)
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.1.block_sparse_moe.gate.bias"] = torch.zeros(4)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.1.block_sparse_moe.gate.bias has no place" in _refused(capsys, src, tmp_path)


def test_moe_models_without_a_transformers_class_are_refused():
    base = {"num_layers": 2, "num_experts": 4, "moe_layer_freq": "1", "qk_layernorm": False}
    assert export_family(base) == "mixtral"
    assert export_family({**base, "qk_layernorm": True}) == "qwen3_moe"
    for change, words in (({"moe_router_score_function": "sigmoid"}, "sigmoid router scores"),
                          ({"moe_shared_expert_intermediate_size": 32}, "a shared expert"),
                          ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax without"),
                          ({"moe_layer_freq": "[0,1]"}, "dense layers without --qk-layernorm")):
        with pytest.raises(CheckpointError, match=words):
            export_family({**base, **change})


def test_an_import_refuses_data_of_another_tokenizer_naming_its_own(hf):
    from engine.training.launch import run_config
    from engine.training.trainer import Trainer
    trainer = Trainer(run_config(TRAIN + ["--load", hf["mixtral"][1], "--mock-data",
                                          "--vocab-size", str(VOCAB)]), launch=LaunchEnv())
    with pytest.raises(CheckpointError) as err:
        trainer.train()
    trainer.close()
    msg = str(err.value)
    assert "\n" not in msg and "None" not in msg, msg
    assert "from tokenizer hf, but this run's data has 320 tokens from mock data" in msg, msg
    assert "prepare --tokenizer-model <the Hugging Face model's directory>" in msg, msg
