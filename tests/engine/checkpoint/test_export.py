"""Export to Hugging Face transformers (logits match ours in fp32) and text generation from a
checkpoint."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from engine.config.cli import parse_args
from engine.data import prepare
from engine.export import main as export_main
from engine.tools.generate import checkpoint_tokenizer, generate_ids, generate_text, load_model
from engine.tools.generate import main as generate_main
from engine.training.trainer import Trainer

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--no-progress", "--lr", "3e-3",
        "--lr-warmup-iters", "1"]


def train(argv):
    trainer = Trainer(parse_args(TINY + argv))
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_export_matches_transformers(tmp_path, block):
    transformers = pytest.importorskip("transformers")
    save = str(tmp_path / "ck")
    # vocab 300 pads to 384 in our layout: export must drop the padding rows
    train(["--block", block, "--mock-data", "--vocab-size", "300", "--train-iters", "3", "--save", save])
    out = str(tmp_path / "hf")
    assert export_main(["--load", save, "--to", "hf", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[block]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _, _ = load_model(save)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)[..., :300]
        got = hf(tokens).logits
    assert got.shape == want.shape == (2, 32, 300)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_export_keeps_the_saved_dtype_or_the_one_asked_for(tmp_path):
    """A bf16 run's weights are exported in bf16 by default (config.json says so), bit for bit
    what the checkpoint holds, and transformers computes our logits from them; ``--dtype fp32``
    writes the same values widened."""
    pytest.importorskip("transformers")
    import transformers
    from safetensors.torch import load_file
    save = str(tmp_path / "ck")
    train(["--block", "llama", "--mock-data", "--vocab-size", "300", "--train-iters", "2",
           "--precision", "bf16", "--save", save])
    outs = {d: str(tmp_path / d) for d in ("auto", "fp32")}
    assert export_main(["--load", save, "--out", outs["auto"]]) == 0
    assert export_main(["--load", save, "--out", outs["fp32"], "--dtype", "fp32"]) == 0
    configs = {d: json.load(open(os.path.join(o, "config.json"))) for d, o in outs.items()}
    assert configs["auto"]["torch_dtype"] == "bfloat16" and configs["fp32"]["torch_dtype"] == "float32"
    half, full = (load_file(os.path.join(outs[d], "model.safetensors")) for d in ("auto", "fp32"))
    assert half.keys() == full.keys() and half
    for k in half:
        assert half[k].dtype == torch.bfloat16 and full[k].dtype == torch.float32, k
        assert torch.equal(half[k].float(), full[k]), k
    ours = dict(load_model(save, dtype=torch.bfloat16)[0].named_parameters())   # the checkpoint's
    assert torch.equal(half["model.layers.0.self_attn.o_proj.weight"], ours["layers.0.attn.proj.weight"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(outs["auto"], dtype=torch.float32).eval()
    fp32, _, _ = load_model(save)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, fp32(tokens)[..., :300], rtol=1e-4, atol=1e-4)


def test_generate_from_checkpoint(tmp_path):
    text = ("the quick brown fox jumps over the lazy dog. " * 40 + "\n") * 3
    (tmp_path / "corpus.txt").write_text(text)
    prefix = str(tmp_path / "data" / "corpus")
    prepare([str(tmp_path / "corpus.txt")], prefix, tokenizer="byte")
    save = str(tmp_path / "ck")
    trainer, _ = train(["--data-path", prefix, "--train-iters", "8", "--save", save])
    model, index, ckpt = load_model(save)
    tok = checkpoint_tokenizer(ckpt, index)
    assert tok.spec == "byte"
    # the single-process trainer and the reloaded checkpoint sample the same text
    a = generate_text(trainer, tok, "the quick", max_new_tokens=12, temperature=0.8, top_k=5, seed=3)
    b = generate_text(model, tok, "the quick", max_new_tokens=12, temperature=0.8, top_k=5, seed=3)
    assert a == b and a.startswith("the quick") and len(a) > len("the quick")
    # greedy decoding is the argmax of the model's logits, one token at a time
    ids = tok.encode("the quick")
    new = generate_ids(model, ids, max_new_tokens=4, temperature=0)
    with torch.no_grad():
        seq = list(ids)
        for _ in range(4):
            seq.append(int(model(torch.tensor([seq]))[0, -1, :index["model"]["vocab_size"]].argmax()))
    assert new == seq[len(ids):]


class _Scripted(torch.nn.Module):
    """A whole model that greedily continues with the ids of ``script``, then ends the text."""

    def __init__(self, script, vocab, stop):
        super().__init__()
        self.script, self.stop, self.w = script, stop, torch.nn.Parameter(torch.zeros(1))
        self.cfg = SimpleNamespace(max_position_embeddings=64, vocab_size=vocab)

    def forward(self, x):
        logits = torch.zeros(1, x.shape[1], self.cfg.vocab_size)
        logits[0, -1, self.script[x.shape[1]] if x.shape[1] < len(self.script) else self.stop] = 1.0
        return logits


def test_generated_text_keeps_the_space_a_sentencepiece_style_decoder_strips():
    """A Metaspace tokenizer (Llama-2's and Mistral's kind) decodes a text without the space
    its first word starts with: the continuation is decoded after the prompt, not alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from engine.data.hf_tokenizer import HFTokenizer
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(prepend_scheme="first")
    bpe.train_from_iterator(["Hello world. The quick brown fox jumps over the lazy dog. " * 20],
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = HFTokenizer(bpe, eot_id=2)
    script = tok.encode("Hello world")
    model = _Scripted(script, tok.vocab_size, tok.eot_id)
    trainer = SimpleNamespace(ps=SimpleNamespace(world_size=1), chunks=[model])
    assert generate_text(trainer, tok, "Hello", max_new_tokens=8, temperature=0) == "Hello world"


def test_generate_cli(tmp_path, capsys):
    save = str(tmp_path / "ck")
    train(["--mock-data", "--vocab-size", "257", "--train-iters", "1", "--save", save])
    assert generate_main(["--load", save, "--prompt", "hi"]) == 2  # mock data: no tokenizer
    assert "has no tokenizer" in capsys.readouterr().err
    assert generate_main(["--load", save, "--prompt", "hi", "--tokenizer", "byte",
                          "--max-new-tokens", "5"]) == 0
    assert "sample from" in capsys.readouterr().out


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 1]))


def test_loading_the_weights_checks_their_bytes_only(tmp_path):
    """generate, export and a --finetune load read the weights alone and check those bytes (and
    the header) against their CRCs, not the whole file against its sha256: a flipped byte in the
    optimizer state does not stop them, and does stop a resume, which reads it; a flipped byte in a
    weight stops every load, named down to the tensor."""
    from engine.checkpoint import CheckpointError
    from engine.checkpoint.index import file_damage, is_weight_key, read_index, resolve
    save = str(tmp_path / "ck")
    train(["--mock-data", "--vocab-size", "300", "--train-iters", "2", "--save", save])
    ckpt = resolve(save)
    info = read_index(ckpt)["files"]["rank_00000.safetensors"]
    path = os.path.join(ckpt, "rank_00000.safetensors")
    state = next(k for k in info["tensors"] if k.startswith("optim/exp_avg/"))
    _flip(path, info["tensors"][state][0])
    assert file_damage(path, info, is_weight_key) is None
    assert f"tensor {state!r} does not match its checksum" in file_damage(path, info)
    load_model(save)                                                    # the weights are intact
    assert export_main(["--load", save, "--out", str(tmp_path / "hf")]) == 0
    _, result = train(["--mock-data", "--vocab-size", "300", "--train-iters", "1", "--load", save,
                       "--finetune"])
    assert len(result.records) == 1
    with pytest.raises(CheckpointError, match=f"tensor {state!r} does not match its checksum"):
        train(["--mock-data", "--vocab-size", "300", "--train-iters", "3", "--load", save])
    _flip(path, info["tensors"][state][0])                               # mended
    weight = "model/embedding.word.weight"
    _flip(path, info["tensors"][weight][0])
    with pytest.raises(CheckpointError, match=f"tensor {weight!r} does not match its checksum"):
        load_model(save)
