"""A CPU double of Transformer Engine's FusedAdam, which megatron-core 0.16.1 builds whenever
Transformer Engine imports (megatron/core/optimizer/__init__.py: `from
transformer_engine.pytorch.optimizers import FusedAdam as Adam`, with `adam_w_mode`). Written
from NVIDIA/TransformerEngine `transformer_engine/pytorch/optimizers/fused_adam.py` and the
update of `transformer_engine/common/multi_tensor/adam.cu` (`adam_update`); TE itself needs
CUDA. What a checkpoint depends on follows TE exactly:

- the step count is per parameter GROUP: `step()` does `group["step"] += 1`, or sets it to 1
  the first time ("assume same step across group now"); no parameter has a `step`;
- a parameter's state is `exp_avg` and `exp_avg_sq` (fp32 zeros, `initialize_state`, at its
  first step); `master_param` only with `master_weights=True`, which megatron asks for only
  with its precision-aware optimizer (not used by rl-async);
- the update: `adam_update` with the corrections 1 - beta^step of the group's step; mode 1
  (AdamW, `adam_w_mode=True`) adds weight decay to the update, mode 0 to the gradient.

`install(monkeypatch)` makes megatron-core build this class where it would build TE's.
"""

from __future__ import annotations

import torch


class FusedAdamDouble(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction=True,
                 adam_w_mode=True, capturable=False, master_weights=False, **_options):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights:
            raise NotImplementedError("the double models the FusedAdam megatron-core builds "
                                      "for rl-async: not capturable, no master weights")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction,
                                  "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0

    def initialize_state(self, param, store_param_remainders: bool = False) -> None:
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            c1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g, r_p = p.grad.float(), p.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode == 0:  # L2
                    g = g + decay * r_p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + eps)
                if self.adam_w_mode == 1:  # decoupled weight decay
                    update = update + decay * r_p
                p.copy_(r_p - lr * update)
        return loss


def install(monkeypatch) -> None:
    """megatron-core builds FusedAdamDouble where it would build TE's FusedAdam."""
    import megatron.core.optimizer as optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib

    monkeypatch.setattr(optimizer, "Adam", FusedAdamDouble)
    monkeypatch.setattr(optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib, "Adam", FusedAdamDouble)  # its isinstance check
