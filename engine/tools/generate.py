"""``python -m engine.generate --load DIR --prompt TEXT``: sample text from any checkpoint.

The model is rebuilt in one process (tp=pp=dp=1) from the configuration stored in the checkpoint and
reads the full logical tensors, whatever layout saved them. The tokenizer comes with the checkpoint
(its copy of the BPE or Hugging Face tokenizer, or the "byte" spec, or the data prefix it was
trained on); ``--tokenizer-model`` names another one (a tokenizer.json or a HF directory).
Decoding recomputes the whole window for every token (no KV cache): simple, and fast enough for the
small models trained here.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from engine.checkpoint import CheckpointError, load_model_params, param_specs
from engine.checkpoint.index import TensorReader, intact_hint, read_index, resolve, verify
from engine.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from engine.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from models import GPTConfig, LayerContext
from models.gpt import GPTChunk
from parallel.state import ParallelState
from parallel.tensor_parallel import Initializer


def load_model(path: str, registry=None, device: str = "cpu") -> tuple[GPTChunk, dict, str]:
    """The whole model of checkpoint ``path`` in one process, in eval mode, plus its index and
    directory. Every file is verified against its checksum first."""
    ckpt = resolve(path)
    index = read_index(ckpt)
    problems = verify(ckpt, index)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))
    cfg = GPTConfig(**index["model"])
    ps = ParallelState.serial(device)
    chunk = GPTChunk(cfg, ps, LayerContext(Initializer(cfg.seed, cfg.init_std)), range(cfg.num_layers),
                     registry=registry).to(device)
    load_model_params(param_specs([chunk], ps, cfg.vocab_size), TensorReader(ckpt, index))
    return chunk.eval(), index, ckpt


def checkpoint_tokenizer(ckpt: str, index: dict):
    """The tokenizer the checkpoint's data was encoded with."""
    data = index["data"]
    if os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        if data["tokenizer"] == "hf" or data["tokenizer"] is None:
            return HFTokenizer.from_file(os.path.join(ckpt, "tokenizer.json"), eot_id=data.get("eot_id"))
        return BPETokenizer.load(os.path.join(ckpt, "tokenizer.json"), data["tokenizer"])
    if data["tokenizer"] == "byte":
        return ByteTokenizer()
    if data["prefix"] and os.path.isfile(f"{data['prefix']}.json"):
        return load_tokenizer(data["prefix"])
    raise CheckpointError(f"checkpoint {ckpt} has no tokenizer (it was trained on "
                          f"{'mock data' if data['mock'] else data['prefix']}): pass --tokenizer "
                          f"byte, a prepared data prefix, or --tokenizer-model")


@torch.no_grad()
def generate_ids(model: GPTChunk, ids: list[int], max_new_tokens: int = 64, temperature: float = 0.8,
                 top_k: int | None = 40, seed: int = 0, stop_id: int | None = None) -> list[int]:
    """Continue ``ids``; temperature 0 is greedy. Returns only the new ids (stops at ``stop_id``)."""
    if not ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
    window = model.cfg.max_position_embeddings
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = list(ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([out[-window:]], device=device)  # (1, s)
        logits = model(x)[0, -1, :model.cfg.vocab_size].float().cpu()  # padding columns dropped
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt == stop_id:
            break
        out.append(nxt)
        new.append(nxt)
    return new


def generate_text(trainer_or_model, tokenizer, prompt: str, max_new_tokens: int = 64,
                  temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> str:
    """``prompt`` followed by a sampled continuation, from a GPTChunk holding the whole model or a
    single-process Trainer (a sharded trainer cannot run the model alone: load its checkpoint)."""
    model = trainer_or_model
    if not isinstance(model, GPTChunk):
        if model.ps.world_size != 1:
            raise ValueError("generate_text needs the whole model in this process; run python -m "
                             "engine.generate --load CHECKPOINT on the saved checkpoint instead")
        model = model.chunks[0]
    was_training = model.training
    model.eval()
    try:
        new = generate_ids(model, tokenizer.encode(prompt), max_new_tokens, temperature, top_k, seed,
                           getattr(tokenizer, "eot_id", None))
    finally:
        model.train(was_training)
    return prompt + tokenizer.decode(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__)
    parser.add_argument("--load", required=True, help="checkpoint directory (or its --save root)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="override: 'byte' or a prepared data prefix")
    parser.add_argument("--tokenizer-model", help="override: a tokenizer.json or a Hugging Face "
                                                  "tokenizer directory")
    args = parser.parse_args(argv)
    try:
        model, index, ckpt = load_model(args.load)
        if args.tokenizer_model:
            tok = load_hf_tokenizer(args.tokenizer_model)
        elif args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        else:
            tok = checkpoint_tokenizer(ckpt, index)
        if tok.vocab_size > index["model"]["vocab_size"]:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model only "
                             f"{index['model']['vocab_size']}: pass the tokenizer it was trained with")
        text = generate_text(model, tok, args.prompt, args.max_new_tokens, args.temperature,
                             args.top_k, args.seed)
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"gridtron: {exc}", file=sys.stderr)
        return 1
    print(f"--- sample from {ckpt} (step {index['step']}) ---\n{text}")
    return 0
