"""--attention-dropout (Megatron's) drops attention probabilities apart from --dropout's residual
branches and embeddings, and defaults to --dropout."""
import torch

from models import LayerContext
from models.config import GPTConfig
from models.gpt import GPTChunk
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer


def outputs(**dropouts) -> tuple[torch.Tensor, torch.Tensor, GPTChunk]:
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, **dropouts)
    model = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(0, 0.2)), range(1))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    train = model.train()(x)
    with torch.no_grad():
        return train.detach(), model.eval()(x), model


def test_attention_dropout_alone_drops_attention():
    train, evaluated, model = outputs(dropout=0.0, attention_dropout=0.5)
    assert model.layers[0].attn.dropout == 0.5
    assert not torch.allclose(train, evaluated)          # the probabilities' dropout ran
    train, evaluated, model = outputs(dropout=0.0)
    assert model.layers[0].attn.dropout == 0.0 and torch.equal(train, evaluated)


def test_hidden_dropout_leaves_attention_when_attention_dropout_is_zero():
    assert outputs(dropout=0.3, attention_dropout=0.0)[2].layers[0].attn.dropout == 0.0
    assert outputs(dropout=0.3)[2].layers[0].attn.dropout == 0.3   # default: --dropout
