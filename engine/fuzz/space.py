"""The fuzzer's space: every layout the engine trains as the serial model, drawn constructively.

A ``Case`` is one combination of the parallel dimensions and switches that docs/design.md's
equivalence covers (fp32, dropout 0, dropless routing): tp, cp, pp, dp, ep, etp, the pipeline
schedule and its virtual stages, sequence parallelism, the ZeRO stage (1-3: the distributed
optimizer, its gradients, the parameters) and its overlapped gather, the optimizer's host offload
(half or all of it), the overlapped gradient reduction, the TP overlap, recomputation, the block
kind (gpt2, llama, MoE on either, a user's block), grouped-query attention, packed documents, the
MoE dispatcher and grouped GEMM, its router (softmax, or sigmoid with the expert bias) and which
layers are MoE layers, query-key norms, the grid's rank order, the pipeline's end-stage weight, the
CP attention and the gradient bucket size. Every run also validates once, at its last step, and its
validation loss is compared too. ``draw(rng, ranks)``
picks each choice among the values the choices before it allow, so every draw is valid: no
combination is launched and then refused (tests check a few hundred draws against the trainer's own
validation). The model is small and the same for every layout of one model key
(``Case.model_flags``), so one serial run is the reference of many cases.

Worked example: ``draw(random.Random(0), 8)`` first picks a world size (2, 4 or 8), then tp from its
divisors, then cp, pp and dp = world / (tp cp pp); the schedule among those pp allows (interleaved
only with 2+ micro-batches per pipeline rank's multiple), and so on down to the MoE dispatcher.
``Case.spec()`` writes it as ``tp=2,cp=1,pp=2,...``, ``Case.parse(spec)`` reads it back. The
choices added after the first seeded samples were recorded (``EXTRA_FIELDS``) are drawn from a
generator seeded by the case's other choices, so a seed still draws the cases it drew before, each
with these choices added.

Not drawn, and why: bf16, fp16 and FP8 (their rounding differs between layouts by design; the
mixed-precision and FP8 tests hold them to their own bounds), dropout (its streams are per TP rank
and pipeline stage), a capacity factor (capacity is per rank and micro-batch) and the global
``aux_loss`` (pooled per micro-step), none of which trains the serial model bit for bit in fp32;
gradient compression (lossy: the compression tests run it under the stream checker); ``--compile``
(minutes of Inductor per case on a CPU: tests/engine/device runs it against eager). ``--screen``
draws all but ``--compile`` on these layouts and judges them without equality (screen.py).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "1f1b-w", "zb-h1", "zb-v")
BLOCKS = ("gpt2", "llama", "user")
CP_COMMS = ("p2p", "a2a")
RECOMPUTES = ("none", "selective", "full")
DISPATCHERS = ("alltoall", "allgather")
ROUTERS = ("softmax", "sigmoid")          # sigmoid: with the aux-loss-free expert bias
ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp", "dp-tp-cp-pp")
EXTRA_FIELDS = ("qk_norm", "router", "moe_freq", "order", "end_weight")
USER_BLOCK = "examples.parallel_block:ParallelResidualBlock"
HIDDEN, HEADS, SEQ, VOCAB, GLOBAL_BATCH = 32, 4, 32, 24, 8
EXPERTS, TOPK, EXPERT_FFN, GROUPS = 4, 2, 24, 2
BASE = ["--mock-data", "--vocab-size", str(VOCAB), "--hidden-size", str(HIDDEN),
        "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
        "--global-batch-size", str(GLOBAL_BATCH), "--precision", "fp32", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--clip-grad", "1.0", "--device", "cpu", "--no-progress",
        "--peak-tflops", "1"]
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@dataclass(frozen=True)
class Case:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    vp: int = 1                      # virtual stages of the interleaved schedule (zb-v: 2 itself)
    micro: int = 1                   # micro-batch size
    sp: bool = False
    tp_overlap: bool = False
    cp_comm: str = "p2p"
    zero: int = 0                    # 0: the plain optimizer; 1, 2, 3: the distributed optimizer
    overlap_gather: bool = False
    offload: int = 0                 # percent of the optimizer state in host memory (zero >= 1)
    overlap_reduce: bool = True
    recompute: str = "none"
    block: str = "gpt2"
    layers: int = 2
    gqa: bool = False
    packed: bool = False
    moe: bool = False
    ep: int = 1
    etp: int = 1
    dispatcher: str = "alltoall"
    grouped: bool = False
    bucket_kb: int = 0               # DP gradient bucket size in KiB; 0: the default (25 MB)
    qk_norm: bool = False            # RMSNorm over each head's query and key
    router: str = "softmax"
    moe_freq: int = 1                # every moe_freq-th layer is an MoE layer, from layer 0
    order: str = "tp-cp-dp-pp"       # the grid's rank order
    end_weight: int = 0              # --stage-end-weight (0: layers split by count)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    # ---- flags ---------------------------------------------------------------------------------
    def model_flags(self) -> list[str]:
        """The model and its data: what the serial reference shares."""
        flags = ["--num-layers", str(self.layers),
                 "--block", USER_BLOCK if self.block == "user" else self.block]
        if self.gqa:
            flags += ["--num-query-groups", str(GROUPS)]
        if self.qk_norm:
            flags.append("--qk-layernorm")
        if self.packed:
            flags += PACKED
        if self.moe:
            flags += ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
                      "--moe-ffn-hidden-size", str(EXPERT_FFN),
                      "--moe-router-load-balancing-type", "seq_aux_loss",
                      "--moe-aux-loss-coeff", "0.01"]
            if self.router == "sigmoid":
                flags += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
            if self.moe_freq > 1:
                flags += ["--moe-layer-freq", str(self.moe_freq)]
        return flags

    def layout_flags(self) -> list[str]:
        flags = ["--tp", str(self.tp), "--cp", str(self.cp), "--pp", str(self.pp),
                 "--dp", str(self.dp), "--micro-batch-size", str(self.micro),
                 "--recompute", self.recompute, "--order", self.order]
        if self.pp > 1:
            flags += ["--pipeline-schedule", self.schedule]
            if self.vp > 1:
                flags += ["--virtual-pipeline-size", str(self.vp)]
            if self.end_weight:
                flags += ["--stage-end-weight", str(self.end_weight)]
        if self.sp:
            flags.append("--sequence-parallel")
        if self.tp_overlap:
            flags.append("--tp-comm-overlap")
        if self.cp > 1:
            flags += ["--cp-comm-type", self.cp_comm]
        if self.zero:
            flags += ["--use-distributed-optimizer", "--zero-stage", str(self.zero),
                      "--overlap-param-gather" if self.overlap_gather else "--no-overlap-param-gather"]
        if self.offload:
            flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                      f"{self.offload / 100:g}"]
        if not self.overlap_reduce:
            flags.append("--no-overlap-grad-reduce")
        if self.bucket_kb:  # small buckets: one block's parameters in several
            flags += ["--bucket-size-mb", f"{self.bucket_kb / 1024:g}"]
        if self.moe:
            flags += ["--ep", str(self.ep), "--expert-tensor-parallel-size", str(self.etp),
                      "--moe-token-dispatcher-type", self.dispatcher]
            flags.append("--moe-grouped-gemm" if self.grouped else "--no-moe-grouped-gemm")
        return flags

    def argv(self, steps: int) -> list[str]:
        return BASE + _steps(steps) + self.model_flags() + self.layout_flags()

    def serial_argv(self, steps: int) -> list[str]:
        """The serial reference: one process, one micro-batch of the whole global batch."""
        return BASE + _steps(steps) + self.model_flags() + ["--micro-batch-size", str(GLOBAL_BATCH)]

    def model_key(self) -> tuple:
        return tuple(self.model_flags())

    def command(self, steps: int) -> str:
        """The run itself under torchrun with the stream checker (without the comparison)."""
        return (f"torchrun --standalone --nproc-per-node {self.world} -m engine.train "
                + " ".join(self.argv(steps)) + " --stream-check")

    # ---- text ----------------------------------------------------------------------------------
    def spec(self) -> str:
        """``field=value,...`` for the fields that differ from the defaults."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
        return ",".join(out) or "serial"

    @classmethod
    def parse(cls, spec: str) -> "Case":
        """The inverse of ``spec``; a ValueError names a field or value it does not know."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, spec.strip().split(",")):
            if item == "serial":
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in kinds:
                raise ValueError(f"--case {spec!r}: {item!r} is not field=value with a field of "
                                 f"{', '.join(kinds)}")
            kind = kinds[key]
            if kind == "bool" and value.strip() not in ("0", "1"):
                raise ValueError(f"--case {spec!r}: {key} takes 0 or 1, got {value!r}")
            try:
                values[key] = (bool(int(value)) if kind == "bool" else
                               int(value) if kind == "int" else value.strip())
            except ValueError:
                raise ValueError(f"--case {spec!r}: {key} takes {kind}, got {value!r}") from None
        return cls(**values)

    def problem(self) -> str | None:
        """What is wrong with the case's own fields, said in the case's terms (``zero=9``, not
        ``--zero-stage``), or None: values outside a field's range, and fields that mean nothing
        without another (the run would silently leave them out). Combinations the trainer refuses
        beyond these (tp=3 with 4 heads) are the trainer's to say."""
        for key in ("tp", "cp", "pp", "dp", "vp", "micro", "layers", "ep", "etp"):
            if getattr(self, key) < 1:
                return f"{key} takes 1 or more, got {getattr(self, key)}"
        for key, options in (("schedule", SCHEDULES), ("cp_comm", CP_COMMS),
                             ("recompute", RECOMPUTES), ("block", BLOCKS),
                             ("dispatcher", DISPATCHERS), ("router", ROUTERS)):
            if getattr(self, key) not in options:
                return f"{key} takes {', '.join(options)}, got {getattr(self, key)}"
        if self.zero not in (0, 1, 2, 3):
            return (f"zero takes 0 (the plain optimizer) or 1, 2, 3 (the distributed optimizer's "
                    f"ZeRO stage), got {self.zero}")
        if not 0 <= self.offload <= 100:
            return (f"offload takes the percent of the optimizer state kept in host memory, 0 "
                    f"(none) to 100, got {self.offload}")
        if self.moe_freq < 1 or self.end_weight < 0:
            return (f"moe_freq takes 1 or more, end_weight 0 or more, got {self.moe_freq} and "
                    f"{self.end_weight}")
        if self.bucket_kb < 0:
            return f"bucket_kb takes a size in KiB (0: the default), got {self.bucket_kb}"
        needs = [("offload", self.offload, self.zero, "zero=1, 2 or 3 (it offloads the "
                                                      "distributed optimizer's state)"),
                 ("overlap_gather", self.overlap_gather, self.zero, "zero=1, 2 or 3"),
                 ("tp_overlap", self.tp_overlap, self.sp, "sp=1"),
                 ("sp", self.sp, self.tp > 1, "tp=2 or more"),
                 ("vp", self.vp > 1, self.pp > 1, "pp=2 or more"),
                 ("end_weight", self.end_weight, self.pp > 1, "pp=2 or more"),
                 ("moe", self.moe, self.block != "user", "block=gpt2 or llama (the user block "
                                                         "builds no MoE layer)"),
                 ("schedule", self.schedule != "1f1b", self.pp > 1, "pp=2 or more"),
                 ("cp_comm", self.cp_comm != "p2p", self.cp > 1, "cp=2 or more")]
        needs += [(key, getattr(self, key) != default, self.moe, "moe=1")
                  for key, default in (("ep", 1), ("etp", 1), ("dispatcher", "alltoall"),
                                       ("grouped", False), ("router", "softmax"),
                                       ("moe_freq", 1))]
        for key, given, met, what in needs:
            if given and not met:
                value = getattr(self, key)
                return f"{key}={int(value) if isinstance(value, bool) else value} needs {what}"
        return None


def _steps(steps: int) -> list[str]:
    """The run's length, and one validation at its last step (one global batch)."""
    return ["--train-iters", str(steps), "--eval-interval", str(steps), "--eval-iters", "1"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw(rng: random.Random, ranks: int) -> Case:
    """One valid case for ``ranks`` processes at most (a power of two >= 2)."""
    world = rng.choice([w for w in (2, 4, 8) if w <= ranks])
    block = rng.choice(BLOCKS)
    moe = block != "user" and rng.random() < 0.4
    tp = rng.choice([t for t in _divisors(world) if t <= HEADS])
    cp = rng.choice(_divisors(world // tp))
    pp = rng.choice(_divisors(world // (tp * cp)))
    dp = world // (tp * cp * pp)
    micro = rng.choice([m for m in (1, 2) if GLOBAL_BATCH % (m * dp) == 0])
    n_micro = GLOBAL_BATCH // (micro * dp)
    schedule, vp = "1f1b", 1
    if pp > 1:
        options = [s for s in SCHEDULES if s != "interleaved" or n_micro % pp == 0]
        schedule = rng.choice(options)
        vp = 2 if schedule == "interleaved" else 1
    chunks = 2 if schedule == "zb-v" and pp > 1 else vp
    layers = pp * chunks * rng.choice([1, 2] if pp * chunks <= 4 else [1])
    layers = max(layers, 2)
    sp = tp > 1 and rng.random() < 0.6
    tp_overlap = sp and rng.random() < 0.4
    cp_comm = "p2p"
    if cp > 1:
        cp_comm = rng.choice(["p2p", "a2a"] if (HEADS // tp) % cp == 0 else ["p2p"])
    zero = rng.choice([0, 1, 2, 3]) if dp * cp > 1 else 0
    overlap_gather = zero > 0 and rng.random() < 0.7
    offload = rng.choice([0, 0, 50, 100]) if zero else 0
    gqa = tp <= GROUPS and rng.random() < 0.4
    packed = rng.random() < 0.3
    ep = etp = 1
    dispatcher, grouped = "alltoall", False
    if moe:
        ep = rng.choice([e for e in _divisors(dp * cp) if EXPERTS % e == 0])
        etp = rng.choice([1, tp]) if tp > 1 else 1
        dispatcher = rng.choice(["alltoall", "allgather"])
        grouped = rng.random() < 0.5
    case = Case(tp=tp, cp=cp, pp=pp, dp=dp, schedule=schedule, vp=vp, micro=micro, sp=sp,
                tp_overlap=tp_overlap, cp_comm=cp_comm, zero=zero, overlap_gather=overlap_gather,
                offload=offload,
                overlap_reduce=rng.random() < 0.8, recompute=rng.choice(["none", "selective", "full"]),
                block=block, layers=layers, gqa=gqa, packed=packed, moe=moe, ep=ep, etp=etp,
                dispatcher=dispatcher, grouped=grouped, bucket_kb=rng.choice([0, 1, 4]))
    return _with_extras(case)


def _with_extras(case: Case) -> Case:
    """``case`` with the ``EXTRA_FIELDS`` drawn by a generator seeded by its other choices (the
    main stream is not consumed). An end-stage weight of 1 splits layers unevenly, so the case
    gets one more layer than its stages hold alike (the plain split would refuse it)."""
    rng = random.Random(case.spec())
    extras = {"qk_norm": rng.random() < 0.3, "order": rng.choice(ORDERS)}
    if case.moe:
        extras["router"] = rng.choice(ROUTERS)
        extras["moe_freq"] = rng.choice([1, 2]) if case.layers >= 2 else 1
    if case.pp > 1 and rng.random() < 0.3:
        extras.update(end_weight=1, layers=case.layers + 1)
    return dataclasses.replace(case, **extras)


def draws(seed: int, ranks: int, count: int) -> list[Case]:
    """``count`` cases of one seeded stream: the same list for the same arguments."""
    rng = random.Random(seed)
    return [draw(rng, ranks) for _ in range(count)]
