"""MasterAdamW: the optimizer that writes the bf16 parameters with the fp32 masters' update.

On CUDA its step is one Triton kernel per parameter (held to torch's fused AdamW on an H200: docs/training.md,
issue 21's eighth session); here, on the CPU, it runs torch's own AdamW and copies. What these tests hold is
the contract the trainer relies on: the bf16 parameters follow the masters after every step (the trainer no
longer copies them), and the state is torch's, so checkpoints move between the two."""

import pytest
import torch

from regen_service.train.adamw import MasterAdamW
from regen_service.train.optim import MasterWeights

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _pair(seed=0):
    """(MasterWeights over two bf16 parameters, its bf16 parameters, their fp32 masters)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 7, generator=g).to(torch.bfloat16)) for _ in range(2)]
    weights = MasterWeights(params)
    return weights, weights.params, weights.masters


def _grads(masters, seed):
    g = torch.Generator().manual_seed(seed)
    for m in masters:
        m.grad = torch.randn(m.shape, generator=g)


def _steps(opt, masters, ref_opt, ref, seeds) -> None:
    """One step of each optimizer per seed, both on the same gradients."""
    for seed in seeds:
        _grads(masters, seed)
        _grads(ref, seed)
        opt.step()
        ref_opt.step()


def test_step_updates_the_masters_as_adamw_and_writes_their_bf16_copies():
    weights, params, masters = _pair()
    ref = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    opt, ref_opt = MasterAdamW(weights, **KW), torch.optim.AdamW(ref, **KW)
    for seed in range(3):
        _steps(opt, masters, ref_opt, ref, [seed])
        for p, m, r in zip(params, masters, ref, strict=True):
            assert torch.equal(m, r)
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.detach().to(torch.bfloat16))


def test_a_master_that_is_its_own_parameter_is_left_as_it_is():
    w = torch.nn.Parameter(torch.ones(3))
    opt = MasterAdamW(MasterWeights([w]), **KW)
    w.grad = torch.ones(3)
    opt.step()
    assert w.dtype == torch.float32 and float(w.detach()[0]) < 1.0


def test_state_moves_between_it_and_torch_adamw():
    weights, _, masters = _pair()
    opt = MasterAdamW(weights, **KW)
    for step in range(2):
        _grads(masters, step)
        opt.step()
    plain = torch.optim.AdamW([torch.nn.Parameter(m.detach().clone()) for m in masters], **KW)
    plain.load_state_dict(opt.state_dict())
    assert float(plain.state[plain.param_groups[0]["params"][0]]["step"]) == 2.0
    back = MasterAdamW(_pair(1)[0], **KW)
    back.load_state_dict(plain.state_dict())
    assert not back._host_steps  # read again from the loaded state at the next step
    assert set(back.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_closure_is_refused():
    with pytest.raises(ValueError, match="closure"):
        MasterAdamW(_pair()[0], **KW).step(lambda: 0.0)


def _kernel_math(p, g, m, v, out, grad_scale, *, lr, weight_decay, beta1, beta2, eps, step):
    """adamw_'s Triton kernel, line for line in torch: what the CUDA path computes per entry."""
    g = g / grad_scale if grad_scale is not None else g
    p.sub_(lr * weight_decay * p)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    p.sub_(lr / (1 - beta1**step) * m / (v.sqrt() / (1 - beta2**step) ** 0.5 + eps))
    if out is not None:
        out.copy_(p)


def test_the_kernel_path_counts_steps_per_parameter_and_across_a_load(monkeypatch):
    """The CUDA path's bookkeeping (state laid out as torch's fused AdamW, the step count on the host, read
    back once after a load, the shadows written, grad_scale divided in), run here with the kernel's math in
    torch, against torch's fused AdamW (its CPU kernel) with the same grad_scale."""
    import regen_service.train.adamw as A

    monkeypatch.setattr(A, "adamw_", _kernel_math)
    monkeypatch.setattr(MasterAdamW, "_takes", staticmethod(lambda group, p: True))
    weights, params, masters = _pair()
    ref = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    opt, ref_opt = MasterAdamW(weights, **KW), torch.optim.AdamW(ref, fused=True, **KW)
    scale = torch.tensor(1.7)
    opt.grad_scale = ref_opt.grad_scale = scale
    _steps(opt, masters, ref_opt, ref, range(3))
    for p, m, r in zip(params, masters, ref, strict=True):
        assert torch.allclose(m, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    assert [float(opt.state[m]["step"]) for m in masters] == [3.0, 3.0]
    weights2, _, masters2 = _pair(5)
    resumed = MasterAdamW(weights2, **KW)
    with torch.no_grad():
        for a, b in zip(masters2, masters, strict=True):
            a.copy_(b)
    resumed.load_state_dict(opt.state_dict())
    resumed.grad_scale = scale
    _steps(resumed, masters2, ref_opt, ref, [3])  # the 4th step's bias correction, from the loaded count
    for m, r in zip(masters2, ref, strict=True):
        assert torch.allclose(m, r, rtol=1e-6, atol=1e-7)
    assert resumed._host_steps == {id(m): 4 for m in masters2}
