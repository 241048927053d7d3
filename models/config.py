"""The model's own configuration: shapes and block flavour, nothing about the run."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from models.moe.config import check_moe_fields, moe_layer_pattern


def check_finite(cfg, skip: tuple[str, ...] = ()) -> None:
    """Raise ValueError (one line, naming the flag) for the first float field of the dataclass
    ``cfg`` that is nan or infinite: ``--lr nan`` or ``.inf`` in a recipe would otherwise pass every
    ``x > 0`` check and fail mid-run (a nan loss, an overflow in an integer conversion). ``skip``:
    fields whose own check says more."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in skip and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    # help: key/value head groups for grouped-query attention (Megatron's --num-query-groups); each
    # group of num_attention_heads / G query heads shares one key/value head; default: one group per
    # head (plain multi-head attention); G = 1 is multi-query attention
    num_query_groups: int | None = None
    # help: accepted for Megatron-LM compatibility; grouped-query attention is on whenever
    # --num-query-groups is below --num-attention-heads, so this flag changes nothing by itself
    group_query_attention: bool = False
    # help: RMSNorm over each head's query and key (head_dim wide, one weight shared by the heads),
    # after the QKV projection and before rotary embeddings (Megatron's --qk-layernorm; Qwen3, OLMo2)
    qk_layernorm: bool = False
    ffn_hidden_size: int | None = None  # default 4h (gpt2) or 8h/3 rounded to 64 (llama)
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 8192
    block: str = "gpt2"  # a registered name or module:Class
    dropout: float = 0.0
    # help: dropout on attention probabilities (Megatron's --attention-dropout); default: --dropout
    attention_dropout: float | None = None
    init_std: float = 0.02
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    seed: int = 1234
    # mixture of experts (models/moe, docs/moe.md): off unless num_experts is set
    num_experts: int | None = None
    moe_layer_freq: str = "1"  # N: every N-th layer; or a 0/1 list per layer, "[0,1,1,1]"
    moe_ffn_hidden_size: int | None = None  # default ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None  # an always-active shared expert
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = True
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False

    def __post_init__(self) -> None:
        check_finite(self, skip=("moe_expert_capacity_factor",))  # its own line: check_moe_fields
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        n, g = self.num_attention_heads, self.num_query_groups
        if g is None:
            if self.group_query_attention:
                raise ValueError("--group-query-attention needs --num-query-groups G (key/value "
                                 "head groups, a divisor of --num-attention-heads)")
            self.num_query_groups = g = n
        if g < 1 or n % g:
            raise ValueError(f"--num-query-groups {g} must be a positive divisor of "
                             f"--num-attention-heads {n} (each group shares one key/value head)")
        if self.ffn_hidden_size is None:
            if self.block == "llama":
                self.ffn_hidden_size = (int(8 * self.hidden_size / 3) + 63) // 64 * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        elif self.ffn_hidden_size < 1:
            raise ValueError(f"--ffn-hidden-size must be >= 1, got {self.ffn_hidden_size} (leave it "
                             f"out for the block's default width)")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} is longer than the position table "
                             f"({self.max_position_embeddings}); raise --max-position-embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention_dropout is not None and not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"--attention-dropout must be in [0, 1), got {self.attention_dropout}")
        if self.init_std < 0 or self.norm_eps < 0:
            raise ValueError(f"--init-std and --norm-eps must be >= 0, got {self.init_std} and "
                             f"{self.norm_eps}")
        if not self.rope_base > 0:
            raise ValueError(f"--rope-base must be > 0 (rotary frequencies are powers of it), got "
                             f"{self.rope_base}")
        check_moe_fields(self)
        if self.num_experts is not None and not any(moe_layer_pattern(self.moe_layer_freq,
                                                                      self.num_layers)):
            raise ValueError(f"--moe-layer-freq {self.moe_layer_freq} selects none of the "
                             f"{self.num_layers} layers: the model would be dense and "
                             f"--num-experts {self.num_experts} unused; mark at least one layer 1, "
                             f"or drop --num-experts")
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether global layer ``layer_idx`` replaces its MLP by a mixture of experts."""
        if self.num_experts is None:
            return False
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer_idx]

    @property
    def attention_dropout_p(self) -> float:
        """The attention probabilities' dropout: --attention-dropout, else --dropout."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden_size(self) -> int:
        """Width of the key (and of the value) projection: num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim
