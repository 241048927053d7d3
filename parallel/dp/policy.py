"""Per-branch gradient-compression policy, read from the YAML recipe.

    grad_compression:
      default: none               # or int8, topk, or a mapping like a rule without 'pattern'
      warmup_steps: 4             # steps 1..4 exchange uncompressed gradients (default 4)
      variance_refresh: 100       # top-k: Adam's frozen second moment refreshed every 100 steps
      rules:                      # fnmatch on parameter names, first match wins
        - {pattern: "*embed*", compressor: none}
        - {pattern: "*attn*",  compressor: int8, chunk_size: 256}
        - {pattern: "*mlp*",   compressor: topk, ratio: 0.01}

Embeddings and norms are small and sensitive, MLP gradients are large and tolerate sparsification:
a policy lets each branch pay only the error it can afford. The reducer forms buckets per
compressor, so one bucket never mixes two compressors.

Top-k needs at least one warm-up step: Adam's second moment of its parameters is frozen after the
warm-up and refreshed every ``variance_refresh`` steps (parallel/dp/variance.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from parallel.dp.compression import Compressor, Int8Compressor, TopKCompressor

KINDS = ("none", "int8", "topk")
DEFAULT_WARMUP_STEPS = 4       # uncompressed steps before compression starts
DEFAULT_VARIANCE_REFRESH = 100  # steps between refreshes of top-k's frozen second moment
_OPTIONS = {"none": (), "int8": ("chunk_size",), "topk": ("ratio",)}


class PolicyError(ValueError):
    """An invalid compression policy; the message names the offending key."""


@dataclass(frozen=True)
class CompressorSpec:
    """Which compressor a parameter uses; hashable so buckets can be grouped by it."""
    kind: str = "none"
    ratio: float | None = None          # topk: fraction of values sent, in (0, 1]
    chunk_size: int | None = None       # int8: values sharing one scale

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PolicyError(f"compressor: unknown compressor {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.ratio is not None and self.kind != "topk":
            raise PolicyError(f"ratio: only the topk compressor takes a ratio, not {self.kind!r}")
        if self.chunk_size is not None and self.kind != "int8":
            raise PolicyError(f"chunk_size: only the int8 compressor takes a chunk_size, not {self.kind!r}")
        if self.ratio is not None and (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                                       or not 0.0 < self.ratio <= 1.0):
            raise PolicyError(f"ratio: must be a number in (0, 1], got {self.ratio!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool)
                                            or not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise PolicyError(f"chunk_size: must be a positive integer, got {self.chunk_size!r}")

    @property
    def compressed(self) -> bool:
        return self.kind != "none"

    def build(self) -> Compressor | None:
        """A fresh compressor (each bucket owns one: top-k keeps per-bucket residuals)."""
        if self.kind == "int8":
            return Int8Compressor(chunk_size=self.chunk_size or 256)
        if self.kind == "topk":
            return TopKCompressor(ratio=0.01 if self.ratio is None else float(self.ratio))
        return None

    def describe(self) -> str:
        opts = [f"{k}={getattr(self, k)}" for k in _OPTIONS[self.kind] if getattr(self, k) is not None]
        return self.kind + (f"({', '.join(opts)})" if opts else "")

    @classmethod
    def parse(cls, value, where: str) -> "CompressorSpec":
        """From 'int8' or {'compressor': 'topk', 'ratio': 0.01}; errors are prefixed with ``where``."""
        if isinstance(value, str):
            value = {"compressor": value}
        if not isinstance(value, dict):
            raise PolicyError(f"{where}: expected a compressor name or a mapping, got {value!r}")
        kind = value.get("compressor", "none")
        if not isinstance(kind, str):
            raise PolicyError(f"{where}.compressor: expected a name, got {kind!r}")
        if kind not in KINDS:
            raise PolicyError(f"{where}.compressor: unknown compressor {kind!r}; use one of {', '.join(KINDS)}")
        extra = set(value) - {"compressor", "pattern", *_OPTIONS[kind]}
        if extra:
            key = sorted(extra)[0]
            allowed = ", ".join(("compressor", *_OPTIONS[kind]))
            raise PolicyError(f"{where}.{key}: not an option of the {kind} compressor (allowed: {allowed})")
        try:
            return cls(kind, value.get("ratio"), value.get("chunk_size"))
        except PolicyError as exc:
            raise PolicyError(f"{where}.{exc}") from None


@dataclass(frozen=True)
class Rule:
    pattern: str
    spec: CompressorSpec


@dataclass(frozen=True)
class CompressionPolicy:
    default: CompressorSpec = field(default_factory=CompressorSpec)
    warmup_steps: int = 0
    rules: tuple[Rule, ...] = ()
    variance_refresh: int = DEFAULT_VARIANCE_REFRESH

    def __post_init__(self) -> None:
        for key in ("warmup_steps", "variance_refresh"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PolicyError(f"{key}: must be a non-negative integer, got {value!r}")
        if self.any_sparse and self.warmup_steps < 1:
            raise PolicyError("warmup_steps: top-k needs at least 1 uncompressed warm-up step, from "
                              "which Adam's second moment of its parameters is taken; use "
                              f"warmup_steps >= 1 (default {DEFAULT_WARMUP_STEPS})")

    @classmethod
    def none(cls) -> "CompressionPolicy":
        return cls()

    @classmethod
    def uniform(cls, kind: str, ratio: float | None = None, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                variance_refresh: int = DEFAULT_VARIANCE_REFRESH) -> "CompressionPolicy":
        """One compressor for every parameter (the --grad-compression / --grad-compression-ratio flags)."""
        value = {"compressor": kind}
        if kind == "topk" and ratio is not None:
            value["ratio"] = ratio
        spec = CompressorSpec.parse(value, "grad_compression")
        return cls(spec, warmup_steps if spec.compressed else 0, (), variance_refresh)

    @classmethod
    def from_dict(cls, d: dict | None) -> "CompressionPolicy":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise PolicyError(f"grad_compression: expected a mapping, got {d!r}")
        extra = set(d) - {"default", "warmup_steps", "variance_refresh", "rules"}
        if extra:
            raise PolicyError(f"{sorted(extra)[0]}: unknown key; a policy has default, warmup_steps, "
                              f"variance_refresh and rules")
        default = CompressorSpec.parse(d.get("default", "none"), "default")
        rules_in = d.get("rules", []) or []
        if not isinstance(rules_in, (list, tuple)):
            raise PolicyError(f"rules: expected a list of rules, got {rules_in!r}")
        rules = []
        for i, rule in enumerate(rules_in):
            where = f"rules[{i}]"
            if not isinstance(rule, dict):
                raise PolicyError(f"{where}: expected a mapping with pattern and compressor, got {rule!r}")
            pattern = rule.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise PolicyError(f"{where}.pattern: expected a non-empty fnmatch string, got {pattern!r}")
            if "compressor" not in rule:
                raise PolicyError(f"{where}.compressor: missing; use one of {', '.join(KINDS)}")
            rules.append(Rule(pattern, CompressorSpec.parse(rule, where)))
        return cls(default, d.get("warmup_steps", DEFAULT_WARMUP_STEPS), tuple(rules),
                   d.get("variance_refresh", DEFAULT_VARIANCE_REFRESH))

    @classmethod
    def coerce(cls, value) -> "CompressionPolicy":
        """A policy from a policy, its dict form, None, or a config object carrying the flags
        grad_compression, grad_compression_ratio and grad_compression_policy (the dict wins)."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, dict):
            return cls.from_dict(value)
        if hasattr(value, "grad_compression"):
            if getattr(value, "grad_compression_policy", None):
                return cls.from_dict(value.grad_compression_policy)
            return cls.uniform(value.grad_compression, getattr(value, "grad_compression_ratio", None),
                               getattr(value, "grad_compression_warmup_steps", DEFAULT_WARMUP_STEPS),
                               getattr(value, "grad_compression_variance_refresh",
                                       DEFAULT_VARIANCE_REFRESH))
        raise PolicyError(f"grad_compression: expected a policy mapping, got {type(value).__name__}")

    def compressor_for(self, name: str) -> CompressorSpec:
        """The spec of the first rule whose pattern matches ``name`` (case-sensitive), else the default."""
        for rule in self.rules:
            if fnmatchcase(name, rule.pattern):
                return rule.spec
        return self.default

    def active(self, step: int) -> bool:
        """Whether compression applies at 1-based optimizer ``step`` (after the warm-up steps)."""
        return step > self.warmup_steps

    @property
    def any_compressed(self) -> bool:
        return self.default.compressed or any(r.spec.compressed for r in self.rules)

    @property
    def any_sparse(self) -> bool:
        return self.default.kind == "topk" or any(r.spec.kind == "topk" for r in self.rules)
