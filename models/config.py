"""The model's own configuration: shapes and block flavour, nothing about the run."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4h (gpt2) or 8h/3 rounded to 64 (llama)
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 8192
    block: str = "gpt2"  # a registered name or module:Class
    dropout: float = 0.0
    init_std: float = 0.02
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    seed: int = 1234

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            if self.block == "llama":
                self.ffn_hidden_size = (int(8 * self.hidden_size / 3) + 63) // 64 * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} is longer than the position table "
                             f"({self.max_position_embeddings}); raise --max-position-embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
