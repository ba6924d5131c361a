"""The log-prob op as a torch.library custom op: opcheck, and torch.compile without breaks."""

import pytest
import torch
from conftest import available_impls

import areal_fast as af
from areal_fast.ops.logprobs import linear_logprobs_fwd_op

IMPLS = [impl for impl in available_impls() if impl != "triton"]  # triton: see gpu_check.sh


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_bias,want_entropy", [(False, True), (True, False)])
def test_opcheck(impl, with_bias, want_entropy, fresh_seed):
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(23, 8, requires_grad=True)
    bias = torch.randn(23, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 23, (9,))
    torch.library.opcheck(
        linear_logprobs_fwd_op, (hidden, weight, labels, bias, 0.8, -100, want_entropy, impl)
    )


def test_compiles_without_graph_breaks(fresh_seed):
    hidden = torch.randn(20, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    labels[3] = -100

    def objective(h, w, y):
        logp, ent = af.linear_logprobs(h, w, y, return_entropy=True, temperature=0.9)
        return (logp * logp).sum() + ent.sum()

    eager = objective(hidden, weight, labels)
    eager_grads = torch.autograd.grad(eager, (hidden, weight))
    compiled = torch.compile(objective, fullgraph=True, backend="aot_eager")
    value = compiled(hidden, weight, labels)
    grads = torch.autograd.grad(value, (hidden, weight))
    assert torch.allclose(value, eager, rtol=1e-5)
    for got, ref in zip(grads, eager_grads):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.all(grads[0][3] == 0)
