"""--attention-dropout (Megatron's) drops attention probabilities apart from --dropout's residual
branches and embeddings, and defaults to --dropout.

Each case runs a training forward and reads what each dropout received: the probability the
attention kernel was called with, and each hidden ``Dropout`` module's p and whether it changed
its input."""
import torch

import models.layers
from models import LayerContext
from models.config import GPTConfig
from models.gpt import GPTChunk
from models.layers import Dropout
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer


def outputs(**dropouts) -> tuple[torch.Tensor, torch.Tensor, GPTChunk, dict]:
    """(training output, eval output, model, what the training forward's dropouts received:
    ``attention``, the kernel's dropout_p per call; ``hidden``, (p, changed its input) per call of
    a hidden Dropout module)."""
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, **dropouts)
    model = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(0, 0.2)), range(1))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = {"attention": [], "hidden": []}
    kernels, real = models.layers.kernels, models.layers.kernels.attention

    def attention(*args, **kwargs):
        seen["attention"].append(kwargs.get("dropout_p"))
        return real(*args, **kwargs)

    def hidden(module, inputs, output):
        seen["hidden"].append((module.p, not torch.equal(inputs[0], output)))

    hooks = [m.register_forward_hook(hidden) for m in model.modules() if isinstance(m, Dropout)]
    torch.manual_seed(0)
    kernels.attention = attention
    try:
        train = model.train()(x)
    finally:
        kernels.attention = real
        for h in hooks:
            h.remove()
    assert seen["attention"] and seen["hidden"], seen   # the layer's attention and hidden dropouts ran
    with torch.no_grad():
        return train.detach(), model.eval()(x), model, seen


def test_attention_dropout_alone_drops_attention():
    train, evaluated, model, seen = outputs(dropout=0.0, attention_dropout=0.5)
    assert model.layers[0].attn.dropout == 0.5
    assert seen["attention"] == [0.5]
    assert all(p == 0.0 and not changed for p, changed in seen["hidden"]), seen   # hidden: untouched
    assert not torch.allclose(train, evaluated)          # the probabilities' dropout ran
    train, evaluated, model, seen = outputs(dropout=0.0)
    assert model.layers[0].attn.dropout == 0.0 and torch.equal(train, evaluated)
    assert seen["attention"] == [0.0] and all(p == 0.0 for p, _ in seen["hidden"]), seen


def test_hidden_dropout_leaves_attention_when_attention_dropout_is_zero():
    _, _, model, seen = outputs(dropout=0.3, attention_dropout=0.0)
    assert model.layers[0].attn.dropout == 0.0 and seen["attention"] == [0.0], seen
    assert all(p == 0.3 and changed for p, changed in seen["hidden"]), seen   # each one dropped some
    _, _, model, seen = outputs(dropout=0.3)
    assert model.layers[0].attn.dropout == 0.3 and seen["attention"] == [0.3], seen   # default: --dropout
    assert all(p == 0.3 and changed for p, changed in seen["hidden"]), seen
