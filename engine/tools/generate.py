"""``python -m engine.generate --load DIR --prompt TEXT``: sample text from any checkpoint.

The model is rebuilt in one process (tp=pp=dp=1) from the configuration stored in the checkpoint and
reads the full logical tensors, whatever layout saved them. The tokenizer comes with the checkpoint
(its copy of the BPE or Hugging Face tokenizer, or the "byte" spec, or the data prefix it was
trained on); ``--tokenizer-model`` names another one (a tokenizer.json or a HF directory).
Decoding recomputes the whole window for every token (no KV cache): simple, and fast enough for the
small models trained here. ``--device`` chooses where the model runs (``auto``, as training does:
an NPU, else a CUDA GPU, else the CPU; the first device of the node) and ``--dtype`` its weights'
dtype (``auto``: bf16 on an accelerator, fp32 on the CPU), as ``--precision`` casts them in
training: an 8B model takes 16 GB in bf16, 32 GB in fp32.
"""
from __future__ import annotations

import math
import os

import torch

from engine.base import ConfigError, ToolParser, run_tool
from engine.checkpoint import CheckpointError, load_model_params, param_specs
from engine.checkpoint.index import intact_hint, is_weight_key, read_index, resolve, verify
from engine.checkpoint.reader import load_buffers
from engine.checkpoint.specs import buffer_specs
from engine.checkpoint.tensor_reader import TensorReader
from engine.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from engine.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from engine.device.chips import precision_problem
from engine.device.runtime import setup_device
from models import GPTConfig, LayerContext
from models.gpt import GPTChunk
from parallel.grid.state import ParallelState
from kernels.dispatch import ALL_FUSED, KernelPaths
from parallel.tensor_parallel import Initializer
from engine.config.schema import PRECISION_DTYPES as DTYPES


def load_model(path: str, registry=None, device: str = "cpu",
               dtype: torch.dtype = torch.float32,
               paths: KernelPaths = ALL_FUSED) -> tuple[GPTChunk, dict, str]:
    """The whole model of checkpoint ``path`` in one process, in eval mode, on ``device`` with
    ``dtype`` weights, plus its index and directory; ``paths``: the fused ops the device's chip
    runs (``DeviceInfo.kernel_paths``, as the trainer hands them down). The weights' bytes are
    verified against their checksums first (the optimizer state is not read)."""
    ckpt = resolve(path)
    index = read_index(ckpt)
    problems = verify(ckpt, index, keys=is_weight_key)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))
    try:
        cfg = GPTConfig(**index["model"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: its model configuration cannot be built ({exc})") from exc
    ps = ParallelState.serial(device)
    ctx = LayerContext(Initializer(cfg.seed, cfg.init_std), kernel_paths=paths)
    chunk = GPTChunk(cfg, ps, ctx, range(cfg.num_layers), registry=registry).to(device=device,
                                                                               dtype=dtype)
    reader = TensorReader(ckpt, index)
    load_model_params(param_specs([chunk], ps, cfg.vocab_size), reader)
    load_buffers(buffer_specs([chunk], ps), reader)   # the MoE routers' expert biases
    return chunk.eval(), index, ckpt


def tokenizer_options(vocab_size: int) -> str:
    """The overrides that fit a model of ``vocab_size`` tokens (only those: the byte tokenizer
    only for the byte tokenizer's own vocabulary)."""
    options = ["--tokenizer byte"] if vocab_size == ByteTokenizer.vocab_size else []
    options += [f"--tokenizer PREFIX (data prepared with a {vocab_size}-token tokenizer)",
                f"--tokenizer-model (a tokenizer of {vocab_size} tokens)"]
    return ", ".join(options[:-1]) + " or " + options[-1]


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
                          f"{'mock data' if data['mock'] else data['prefix']}): pass "
                          f"{tokenizer_options(index['model']['vocab_size'])}")


@torch.no_grad()
def generate_ids(model: GPTChunk, ids: list[int], max_new_tokens: int = 64, temperature: float = 0.8,
                 top_k: int | None = 40, seed: int = 0, stop_id: int | None = None,
                 vocab_limit: int | None = None) -> list[int]:
    """Continue ``ids``; temperature 0 is greedy. Returns only the new ids (stops at ``stop_id``).
    ``vocab_limit``: only ids below it are drawn (a tokenizer smaller than the model's vocabulary
    cannot decode the others)."""
    if not ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
    window = model.cfg.max_position_embeddings
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = list(ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([out[-window:]], device=device)  # (1, s)
        logits = model(x)[0, -1, :model.cfg.vocab_size].float().cpu()  # (v,) padding columns dropped
        if vocab_limit is not None and vocab_limit < logits.numel():
            logits[vocab_limit:] = float("-inf")
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            # the largest logit subtracted first: every scaled logit is then <= 0 and the largest
            # exactly 0, so no temperature > 0 overflows to inf (1e-45 samples the greedy token);
            # in float64, where such a temperature is not a float32 denormal flushed to 0 (0 / 0)
            logits = (logits - logits.max()).double() / temperature
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
        ids = tokenizer.encode(prompt)
        new = generate_ids(model, ids, max_new_tokens, temperature, top_k, seed,
                           getattr(tokenizer, "eot_id", None), getattr(tokenizer, "vocab_size", None))
    finally:
        model.train(was_training)
    return prompt + continuation(tokenizer, ids, new)


def continuation(tokenizer, ids: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``ids``: decoded together with them, as a fragment decoded alone
    can lose its leading space (SentencePiece-style decoders strip the one a text starts with)."""
    head, full = tokenizer.decode(ids), tokenizer.decode(ids + new)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new)


def build_parser() -> ToolParser:
    parser = ToolParser(prog="python -m engine.generate", description=__doc__)
    parser.add_argument("--load", required=True, help="checkpoint directory (or its --save root)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (at least 1)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy; above: sampling")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="override: 'byte' or a prepared data prefix")
    parser.add_argument("--tokenizer-model", help="override: a tokenizer.json or a Hugging Face "
                                                  "tokenizer directory")
    parser.add_argument("--device", default="auto", choices=("auto", "npu", "cuda", "cpu"),
                        help="where the model runs (auto: an NPU, else a CUDA GPU, else the CPU)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                        help="the weights' dtype (auto: fp32 on the CPU, bf16 on an accelerator "
                             "that computes in it, else fp16: Ascend 910A / 910ProB, V100, T4)")
    return parser


def check_args(args) -> None:
    """Every argument of the command line, before anything is loaded (ConfigError)."""
    if not args.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be 0 (greedy) or a positive number, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be 0 (no cut) or positive, got {args.top_k}")
    if not -2 ** 63 <= args.seed < 2 ** 64:   # what torch.Generator.manual_seed takes
        raise ConfigError(f"--seed must be an integer in [-2**63, 2**64), got {args.seed}")
    if args.tokenizer and args.tokenizer_model:
        raise ConfigError("--tokenizer and --tokenizer-model both name a tokenizer: give one")


def pick_tokenizer(args, ckpt: str, index: dict):
    """The tokenizer to use, checked against the model's vocabulary."""
    name = args.tokenizer_model or args.tokenizer
    flag = "--tokenizer-model" if args.tokenizer_model else "--tokenizer"
    try:
        if args.tokenizer_model:
            tok = load_hf_tokenizer(args.tokenizer_model)
        elif args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        else:
            tok = checkpoint_tokenizer(ckpt, index)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a garbled file: json, tokenizers and OS errors alike
        where = f"{flag} {name}" if name else f"the tokenizer of checkpoint {ckpt}"
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where} cannot be loaded ({why})") from exc
    vocab = index["model"]["vocab_size"]
    if tok.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model only {vocab}: "
                          f"pass the tokenizer it was trained with ({tokenizer_options(vocab)})")
    return tok


def run_dtype(asked: str, dev) -> torch.dtype:
    """``--dtype`` on the device ``dev`` (engine/device/runtime.py ``DeviceInfo``): auto is fp32
    on the CPU, else bf16 where the chip computes in it (an NPU the chip table gives bf16, a CUDA
    GPU of compute capability 8.0 or later, or one not told) and fp16 where it does not (Ascend
    910A / 910ProB, V100, T4); bf16 asked for on an NPU without it is a ConfigError."""
    if asked == "auto":
        if dev.type == "cpu":
            return DTYPES["fp32"]
        if dev.type == "npu":
            return DTYPES["bf16" if precision_problem(dev.name, "bf16") is None else "fp16"]
        cap = dev.capability
        return DTYPES["bf16" if cap is None or tuple(cap) >= (8, 0) else "fp16"]
    if asked == "bf16" and dev.type == "npu" and precision_problem(dev.name, "bf16"):
        raise ConfigError(f"--dtype bf16: {dev.name} has no bfloat16 arithmetic; use --dtype fp16 "
                          f"or fp32 (or auto)")
    return DTYPES[asked]


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        check_args(args)
        ckpt = resolve(args.load)
        index = read_index(ckpt)
        tok = pick_tokenizer(args, ckpt, index)
        dev = setup_device(args.device)   # a ValueError: one line, as training's
        dtype = run_dtype(args.dtype, dev)
        model, index, ckpt = load_model(ckpt, device=dev.device, dtype=dtype, paths=dev.kernel_paths)
        device = dev.device
        text = generate_text(model, tok, args.prompt, args.max_new_tokens, args.temperature,
                             args.top_k, args.seed)
        print(f"--- sample from {ckpt} (step {index['step']}, {str(dtype)[6:]} on {device}) "
              f"---\n{text}")
        return 0

    return run_tool(body, (CheckpointError, lambda e: f"checkpoint error: {e}", 2),
                    (ValueError, str, 2))  # e.g. a prompt that encodes to no tokens
