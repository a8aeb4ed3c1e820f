"""The embedded engine's linear layers on CPU through oneDNN, with weights packed once.

Profile (SmolLM2-135M, 2026-12-07): a decode step of the engine was the model's own linear
layers (16 of 18 s of the engine benchmark), and at the engine's batch sizes (1-16 rows) the
stock fp32 `F.linear` (MKL sgemm) re-reads and re-packs every weight on every call: a decode
forward at 11 rows took 88 ms. oneDNN's linear over weights reordered once into its blocked
layout (the kernel torch's own CPU compiler uses) takes 38 ms for the same step, to within
1e-4 of the stock logits. Inference only: the engine never trains, and a module called with
gradients enabled falls back to the stock kernel.

On small layers (the tiny test model's 128-wide ones) oneDNN's per-call cost loses to
the stock kernel (0.76x engine tokens/s), so by default the engine measures both kernels on
its own layer shapes at start (`measure_speedup`) and packs only when oneDNN is clearly faster.

Weights change only through the engine's weight updates, which call `refresh()` under the
step lock, so no step ever runs on a packed copy of old weights (LESSONS miles#2782). The
packed copies cost one more copy of the linear weights in memory.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F


def unsupported_reason(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the oneDNN path cannot serve this model here, or None when it can."""
    if device.type != "cpu":
        return f"device {device} (oneDNN linears are for CPU engines)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_linear_pointwise"):
        return "this torch build has no oneDNN (mkldnn) linear"
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        return f"parameters of dtype {sorted(map(str, dtypes))} (float32 only)"
    return None


def linear_modules(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain `nn.Linear` layers (subclasses, e.g. quantized ones, keep their forward)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def pack_linears(model: torch.nn.Module, device: torch.device, wanted: bool | None,
                 rows: int) -> tuple[PackedLinears | None, float]:
    """engine.onednn_linear: True packs (an error where impossible), False never, None packs
    where supported and measured clearly faster here at `rows` rows. Returns the packed
    linears (None: the stock kernel) and the measured speedup (0 when not measured)."""
    reason = unsupported_reason(model, device) if wanted is not False else None
    if wanted and reason:
        raise ValueError(f"engine.onednn_linear = true: not possible for {reason}; set it "
                         f"to false or leave it unset")
    if wanted is False or reason:
        return None, 0.0
    speedup = 0.0
    if wanted is None:
        speedup = measure_speedup(model, rows)
        if speedup < 1.1:  # a clear margin: the measurement runs on a shared, noisy machine
            return None, speedup
    return PackedLinears(model), speedup


def measure_speedup(model: torch.nn.Module, rows: int, repeats: int = 5) -> float:
    """Stock F.linear time / oneDNN time over one forward's linear layers at `rows` rows
    (each distinct shape timed interleaved, best of `repeats`, weighted by how many layers
    have it). Above 1: oneDNN is faster on this machine for this model."""
    shapes: dict[tuple[int, ...], list[torch.nn.Linear]] = {}
    for m in linear_modules(model):
        shapes.setdefault(tuple(m.weight.shape), []).append(m)
    stock = fast = 0.0
    with torch.inference_mode():
        for layers in shapes.values():
            module = layers[0]
            weight = module.weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            x = torch.randn(rows, module.in_features)
            best = [float("inf"), float("inf")]
            for _ in range(repeats):
                for i, run in enumerate((
                        lambda: F.linear(x, weight, module.bias),
                        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, module.bias,
                                                                   "none", [], ""))):
                    start = time.perf_counter()
                    run()
                    best[i] = min(best[i], time.perf_counter() - start)
            stock += best[0] * len(layers)
            fast += best[1] * len(layers)
    return stock / fast if fast > 0 else 0.0


class PackedLinears:
    """Every `torch.nn.Linear` of `model` runs on its packed weight (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.modules = linear_modules(model)
        # the linears by their weight Parameter (a tied weight serves several of them)
        self.by_weight: dict[int, list[torch.nn.Linear]] = {}
        for m in self.modules:
            self.by_weight.setdefault(id(m.weight), []).append(m)
        self._packed: dict[int, torch.Tensor] = {}
        self.refresh()
        for module in self.modules:
            module.forward = types.MethodType(self._forward_of(id(module)), module)
        self.check()

    def refresh(self) -> None:
        """Re-pack every weight from the parameters as they are now (after a weight load)."""
        self._packed = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
                        for m in self.modules}

    def pack(self, weights: list[tuple[torch.nn.Parameter, torch.Tensor]]
             ) -> dict[int, torch.Tensor]:
        """Packed copies of `tensor` for the linears whose weight is `parameter` (a staged
        bucket's new values), without touching the ones in use: a staged publication packs
        before its commit, outside the engine's pause."""
        out = {}
        for param, tensor in weights:
            modules = self.by_weight.get(id(param), [])
            if modules:
                packed = torch.ops.mkldnn._reorder_linear_weight(tensor.detach())
                out.update({id(m): packed for m in modules})
        return out

    def install(self, packed: dict[int, torch.Tensor], changed: set[int] = frozenset()
                ) -> list[torch.Tensor]:
        """Serve from `packed` (from pack()) from the next call on (under the step lock).
        The linears whose weight (by id) is in `changed` but that `packed` lacks run on the
        stock kernel over their (new) weight until packed copies are installed: never on
        a packed copy of the old one. Returns the replaced packed weights: the caller frees
        them after the lock, so the pause does not include returning their memory."""
        old = [self._packed[k] for k in packed if k in self._packed]
        for weight in changed:
            for m in self.by_weight.get(weight, []):
                if id(m) not in packed and id(m) in self._packed:
                    old.append(self._packed.pop(id(m)))
        self._packed.update(packed)
        return old

    def _forward_of(self, key: int):
        def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
                return F.linear(x, module.weight, module.bias)
            # looked up per call: refresh() and install() swap in the newest weights; none
            # while a commit's packing is still under way (the stock kernel meanwhile)
            packed = self._packed.get(key)
            if packed is None:
                return F.linear(x, module.weight, module.bias)
            return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
        return forward

    def check(self) -> None:
        """One call per distinct shape against the stock kernel: a build whose oneDNN path
        computes something else fails here, at engine start, naming the layer."""
        seen = set()
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for module in self.modules:
                if module.weight.shape in seen:
                    continue
                seen.add(module.weight.shape)
                x = torch.randn(3, module.in_features, generator=generator)
                want = F.linear(x, module.weight, module.bias)
                got = module(x)
                scale = float(want.abs().max()) or 1.0
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
                    raise RuntimeError(
                        f"engine.onednn_linear: the oneDNN linear of a {tuple(module.weight.shape)} "
                        f"layer differs from torch's by {float((got - want).abs().max()):.3g}; "
                        f"set engine.onednn_linear = false")
