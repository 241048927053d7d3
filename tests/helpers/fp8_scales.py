"""Record the FP8 scales a model's layers use (parallel/tensor_parallel/fp8.py), by layer call,
with the largest magnitude of each piece of tensor this rank held for that call.

``ScaleRecorder`` wraps ``Fp8Forward`` / ``Fp8Backward`` construction for as long as it is
entered: each call records its scales and, computed here from the tensors it was handed, this
rank's amax of x, of each weight and of each output gradient; nothing else changes.
``by_weight(names)`` lists, per (pass, logical weight name), every call in the order they ran:
forward [(x scale, x's local amax), (W scale, W's local amax)], backward [(dy scale, dy's local
amax)] (tensorwise recipes: 0-d scales)."""
from __future__ import annotations

from parallel.tensor_parallel import fp8 as fp8_module


def _amax(t) -> float:
    return t.detach().float().abs().max().item()


class ScaleRecorder:
    def __init__(self):
        self.calls: list = []

    def __enter__(self):
        self._inits = fp8_module.Fp8Forward.__init__, fp8_module.Fp8Backward.__init__
        fwd_init, bwd_init = self._inits
        calls = self.calls

        def fwd(obj, spec, x_held, weights):
            fwd_init(obj, spec, x_held, weights)
            calls.append(("forward", obj, [_amax(x_held)] + [_amax(w) for w in weights]))

        def bwd(obj, fwd_call, grads, x_held):
            bwd_init(obj, fwd_call, grads, x_held)
            calls.append(("backward", obj, [None if g is None else _amax(g) for g in grads]))
        fp8_module.Fp8Forward.__init__, fp8_module.Fp8Backward.__init__ = fwd, bwd
        return self

    def __exit__(self, *exc):
        fp8_module.Fp8Forward.__init__, fp8_module.Fp8Backward.__init__ = self._inits

    def by_weight(self, names: dict) -> dict:
        """{(pass, name): [[(scale, local amax), ...] per call]}; ``names``: id(param) -> name."""
        out: dict = {}
        for what, obj, local in self.calls:
            fwd = obj if what == "forward" else obj.fwd
            for i, w in enumerate(fwd.weights):
                if what == "forward":
                    entry = [(obj.x_scale.item(), local[0]), (obj.w_scales[i].item(), local[1 + i])]
                elif i in obj.g_cols:
                    entry = [(obj.g_cols[i].item(), local[i])]
                else:
                    continue
                out.setdefault((what, names[id(w)]), []).append(entry)
        return out
