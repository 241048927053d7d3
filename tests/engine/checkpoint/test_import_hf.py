"""Hugging Face models and tokenizers in: import_hf, --tokenizer-model for prepare and generate,
export's tokenizer files.

Everything is made offline: a byte-level BPE trained with ``tokenizers`` and saved through
transformers' ``GPT2TokenizerFast.save_pretrained`` is the GPT-2 tokenizer directory; tiny GPT-2 and
Llama models are initialised by transformers and saved as safetensors. The imported checkpoints'
logits equal transformers' in fp32 at (tp, pp, dp) = (1, 1, 1) and (2, 2, 1), and greedy generation
picks the same tokens. A Llama-2-style tokenizer (<s> put before every text, </s> ending it, a chat
template) keeps its special tokens and chat template through import, continued pretraining and
export.
"""
import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.checkpoint.import_hf import main as import_main  # noqa: E402
from engine.config.cli import parse_args  # noqa: E402
from engine.training.launch import run_config  # noqa: E402
from engine.data import load_tokenizer  # noqa: E402
from engine.data.__main__ import main as data_main  # noqa: E402
from engine.data.hf_tokenizer import load_hf_tokenizer, resolve_tokenizer  # noqa: E402
from engine.export import main as export_main  # noqa: E402
from engine.tools.generate import generate_ids, load_model  # noqa: E402
from engine.tools.generate import main as generate_main  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.pipeline.p2p import Transfer, communicate  # noqa: E402
from parallel.tensor_parallel.mappings import gather_from_tp  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20
        + "The quick brown fox jumps over the lazy dog. " * 30)
SEQ = 16


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{"tok": GPT-2 tokenizer dir, "gpt2"/"llama": HF model dirs, "prefix": data made with the tokenizer}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("hf")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                         bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok_dir = str(root / "gpt2-tokenizer")
    tok.save_pretrained(tok_dir)
    vocab = len(tok)
    torch.manual_seed(0)
    dirs = {"tok": tok_dir, "vocab": vocab}
    g = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    l_cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                     max_position_embeddings=64, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, bos_token_id=tok.eos_token_id,
                                     eos_token_id=tok.eos_token_id)
    for name, model in (("gpt2", transformers.GPT2LMHeadModel(g)), ("llama", transformers.LlamaForCausalLM(l_cfg))):
        with torch.no_grad():  # larger weights than the default init, so logits differ visibly
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.2)
        path = str(root / name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        dirs[name] = path
        dirs[f"{name}_ck"] = str(root / f"{name}_ck")
        assert import_main(["--load", path, "--save", dirs[f"{name}_ck"]]) == 0
    (root / "text.txt").write_text(TEXT)
    dirs["prefix"] = str(root / "data" / "corpus")
    assert data_main(["prepare", "--input", str(root / "text.txt"), "--output", dirs["prefix"],
                      "--tokenizer-model", tok_dir, "--no-progress"]) == 0
    return dirs


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(vocab):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_prepare_with_a_hugging_face_tokenizer_directory(hf, tmp_path):
    files = set(os.listdir(hf["tok"]))
    assert {"tokenizer.json", "tokenizer_config.json"} <= files  # written by transformers
    ref = transformers.AutoTokenizer.from_pretrained(hf["tok"])
    tok = load_tokenizer(hf["prefix"])
    assert tok.spec == "hf" and tok.eot_id == ref.eos_token_id and tok.vocab_size == len(ref)
    from engine.data.megatron import IndexedTokens
    data = IndexedTokens(hf["prefix"])
    assert data.tokens.tolist() == ref(TEXT)["input_ids"] + [ref.eos_token_id]
    # GPT-2's original files (vocab.json + merges.txt) through Megatron's GPT2BPETokenizer spelling
    vocab, merges = load_hf_tokenizer(hf["tok"])._tok.model.save(str(tmp_path))
    slow = resolve_tokenizer("GPT2BPETokenizer", None, vocab, merges)
    assert slow.encode(TEXT) == ref(TEXT)["input_ids"] and slow.eot_id == ref.eos_token_id
    assert load_hf_tokenizer(os.path.join(hf["tok"], "tokenizer.json")).encode("x = 1") == ref("x = 1")["input_ids"]
    with pytest.raises(ValueError, match="needs --vocab-file and --merge-file"):
        resolve_tokenizer("GPT2BPETokenizer")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_imported_model_matches_transformers_serially(hf, family):
    ref = hf_model(hf[family])
    ours, index, _ = load_model(hf[f"{family}_ck"])
    assert index["step"] == 0 and index["model"]["block"] == family
    x = tokens(hf["vocab"])
    with torch.no_grad():
        want = ref(x).logits
        got = ours(x)[..., :hf["vocab"]]
    assert want.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    prompt = x[0, :5].tolist()
    new = generate_ids(ours, prompt, max_new_tokens=10, temperature=0)
    with torch.no_grad():
        hf_out = ref.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)
    assert new == hf_out[0, 5:].tolist()


def _sharded_logits(ps, cases):
    """Each case (checkpoint, data prefix, tokens): the full logits under this rank's layout."""
    out = []
    for ckpt, prefix, x in cases:
        trainer = Trainer(run_config(["--load", ckpt, "--use-checkpoint-args", "--data-path", prefix,
                                      "--tp", "2", "--pp", "2", "--seq-length", str(SEQ),
                                      "--micro-batch-size", "2", "--global-batch-size", "2",
                                      "--train-iters", "1", "--no-progress", "--device", "cpu",
                                      "--split", "1,0,0"]))
        trainer.maybe_load()
        chunk = trainer.chunks[0].eval()
        b, s, h = x.shape[0], x.shape[1], trainer.cfg.model.hidden_size
        with torch.no_grad():
            if ps.pp_rank == 0:
                act = chunk(x).contiguous()  # (b, s, h)
                communicate(ps, [Transfer("send", act, 1, ps.stage_rank(1), "activation", 0)])
                out.append(None)
            else:
                act = torch.empty(b, s, h)
                communicate(ps, [Transfer("recv", act, 0, ps.stage_rank(0), "activation", 0)])
                out.append(gather_from_tp(chunk(act), ps.tp_group))  # (b, s, V_pad)
    return out


def test_imported_models_match_transformers_at_tp2_pp2(hf):
    x = tokens(hf["vocab"])
    cases = [(hf[f"{f}_ck"], hf["prefix"], x) for f in ("gpt2", "llama")]
    results = run_distributed(_sharded_logits, grid=RankGrid(tp=2, pp=2), args=(cases,), timeout_s=120)
    for i, family in enumerate(("gpt2", "llama")):
        with torch.no_grad():
            want = hf_model(hf[family])(x).logits
        for rank in (2, 3):  # the last stage's two TP ranks
            got = results[rank][i][..., :hf["vocab"]]
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (family, (got - want).abs().max())


def test_generate_with_the_tokenizer_directory_and_export_back(hf, tmp_path, capsys):
    ref = transformers.AutoTokenizer.from_pretrained(hf["tok"])
    assert generate_main(["--load", hf["gpt2_ck"], "--prompt", "def add", "--temperature", "0",
                          "--max-new-tokens", "6", "--tokenizer-model", hf["tok"]]) == 0
    flag = capsys.readouterr().out
    assert generate_main(["--load", hf["gpt2_ck"], "--prompt", "def add", "--temperature", "0",
                          "--max-new-tokens", "6"]) == 0  # the tokenizer copied into the checkpoint
    own = capsys.readouterr().out
    assert flag == own and "def add" in own
    model, _, _ = load_model(hf["gpt2_ck"])
    ids = ref("def add")["input_ids"]
    new = generate_ids(model, ids, 6, temperature=0, stop_id=ref.eos_token_id)
    assert own.rstrip("\n").endswith(ref.decode(ids + new))
    out = str(tmp_path / "exported")
    assert export_main(["--load", hf["gpt2_ck"], "--to", "hf", "--out", out]) == 0
    back = transformers.AutoTokenizer.from_pretrained(out)
    assert back.eos_token == "<|endoftext|>" and back("x = 1")["input_ids"] == ref("x = 1")["input_ids"]
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode) & 0o044 == 0o044, name
    x = tokens(hf["vocab"])
    with torch.no_grad():
        assert torch.allclose(hf_model(out)(x).logits, hf_model(hf["gpt2"])(x).logits, atol=1e-5)


def test_exported_tokenizer_config_from_a_trained_checkpoint(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    prefix = str(tmp_path / "bpe")
    assert data_main(["prepare", "--input", str(tmp_path / "t.txt"), "--output", prefix,
                      "--tokenizer", "bpe:300", "--no-progress"]) == 0
    save = str(tmp_path / "ck")
    trainer = Trainer(parse_args(["--data-path", prefix, "--num-layers", "1", "--hidden-size", "32",
                                  "--num-attention-heads", "4", "--seq-length", "16", "--train-iters", "1",
                                  "--micro-batch-size", "2", "--global-batch-size", "2", "--no-progress",
                                  "--save", save, "--split", "1,0,0"]))
    trainer.train()
    trainer.close()
    out = str(tmp_path / "hf")
    assert export_main(["--load", save, "--to", "hf", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert config["eos_token"] == config["bos_token"] == "<|endoftext|>"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == load_tokenizer(prefix).eot_id


def test_key_value_heads_that_do_not_divide_the_heads_are_refused_in_one_line(hf, tmp_path, capsys):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "gqa"))
    path = tmp_path / "gqa" / "config.json"
    path.write_text(path.read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 3'))
    capsys.readouterr()  # transformers' own progress output
    assert import_main(["--load", str(tmp_path / "gqa"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "num_key_value_heads 3 does not divide num_attention_heads 4" in err
    assert not os.path.exists(tmp_path / "ck" / "latest")


CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    """A Llama-2-style model directory: a Metaspace BPE whose post-processor puts <s> (id 1) before
    every text, </s> (id 2) ending it, <unk> (id 0) the padding, and a chat template; its import
    ("ck") and data prepared with it ("prefix")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    root = tmp_path_factory.mktemp("llama2")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(prepend_scheme="first")
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                        special_tokens=["<unk>", "<s>", "</s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>", pad_token="<unk>")
    tok.chat_template = CHAT
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)
    d = str(root / "hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    assert import_main(["--load", d, "--save", str(root / "ck")]) == 0
    (root / "text.txt").write_text(TEXT)
    prefix = str(root / "data" / "corpus")
    assert data_main(["prepare", "--input", str(root / "text.txt"), "--output", prefix,
                      "--tokenizer-model", d, "--no-progress"]) == 0
    return {"hf": d, "ck": str(root / "ck"), "prefix": prefix}


def _exported(ckpt, out):
    """The export of ``ckpt``: its config.json and its tokenizer as transformers reads it."""
    assert export_main(["--load", ckpt, "--to", "hf", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    return config, transformers.AutoTokenizer.from_pretrained(out)


def test_import_and_export_keep_the_chat_template(llama2, tmp_path):
    _, tok = _exported(llama2["ck"], str(tmp_path / "out"))
    assert tok.chat_template == CHAT
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<s>user: hi</s>"


def test_import_and_export_keep_the_bos_eos_and_pad_tokens(llama2, tmp_path):
    config, tok = _exported(llama2["ck"], str(tmp_path / "out"))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert (tok.bos_token, tok.eos_token, tok("Hello")["input_ids"][0]) == ("<s>", "</s>", 1)


@pytest.mark.parametrize("start", ["load", "load+tokenizer-model", "fresh"])
def test_continued_pretraining_keeps_the_tokenizer_files(llama2, tmp_path, start):
    """One training step on data prepared with the model's tokenizer, from the imported model (its
    tokenizer files come from the --load checkpoint, or from the --tokenizer-model directory) or
    from a fresh model (no tokenizer_config.json anywhere: export names the BOS the tokenizer puts
    first), then export."""
    save = str(tmp_path / "ck")
    argv = ["--data-path", llama2["prefix"], "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1", "--no-progress", "--save", save,
            "--split", "1,0,0"]
    if start == "fresh":
        argv += ["--block", "llama", "--num-layers", "1", "--hidden-size", "32",
                 "--num-attention-heads", "4"]
    else:
        argv += ["--load", llama2["ck"], "--use-checkpoint-args"]
    if start == "load+tokenizer-model":
        argv += ["--tokenizer-model", llama2["hf"]]
    trainer = Trainer(run_config(argv))
    trainer.train()
    trainer.close()
    config, tok = _exported(save, str(tmp_path / "out"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (tok.bos_token, tok.eos_token, tok("Hello")["input_ids"][0]) == ("<s>", "</s>", 1)
    if start != "fresh":
        assert tok.chat_template == CHAT and config["pad_token_id"] == 0
