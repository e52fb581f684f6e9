"""The seam to FSDP2's internals (`hf_tree_attn.fsdp2_compat`), on one gloo process: every internal it names exists
in the installed torch; a torch without them is refused with the reason; and `separate_backward` turns backwards run
from inside an FSDP2 backward of the same model (prefix reuse's chunks inside TRL's fused head) into passes of their
own, whose gradients FSDP2 reduces into the sharded parameters, where without it the second one's are lost."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from hf_tree_attn import fsdp2_compat
from hf_tree_attn.fsdp2_compat import FSDP2_INTERNALS, separate_backward


class _Chunks(torch.autograd.Function):
    """A node computed inside the model's forward whose backward runs one forward and backward of the model per
    input (as prefix reuse runs its chunks), returning no gradient (they are in `.grad` already)."""

    @staticmethod
    def forward(ctx, model, inputs, separate, *params):
        ctx.model, ctx.inputs, ctx.separate, ctx.num_params = model, inputs, separate, len(params)
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        context = ctx.model._get_fsdp_state()._state_ctx
        assert context.post_backward_final_callback_queued  # the outer pass is under way
        for x in ctx.inputs:
            with separate_backward(ctx.model) if ctx.separate else contextlib.nullcontext(), torch.enable_grad():
                if ctx.separate:
                    assert not context.post_backward_final_callback_queued
                ctx.model(x).sum().backward()
            assert context.post_backward_final_callback_queued  # restored for the outer pass
        return (None, None, None) + (None,) * ctx.num_params


class _Net(torch.nn.Module):
    """The root's own layers around an inner FSDP2 module whose input requires a gradient (a decoder layer's): its
    post-backward hook reduces its gradients as the backward leaves it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, chunks=None, separate=True):
        if chunks is not None:
            return _Chunks.apply(self, chunks, separate, *self.parameters())
        return self.head(self.inner(self.embed(x)))


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = _Net()
    reference = copy.deepcopy(net)
    fully_shard(net.inner)
    fully_shard(net)
    return net, reference


def test_the_internals_exist(one_process):
    """Each name of `FSDP2_INTERNALS` on the installed torch, and no other is touched."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    net, _ = _sharded()
    net(torch.randn(2, 4))  # FSDP2 initialises its states in the first forward
    state = net._get_fsdp_state()
    context = state._state_ctx
    assert state in context.all_states and net.inner._get_fsdp_state() in context.all_states
    assert context.post_backward_final_callback_queued is False
    assert state._training_state == TrainingState.IDLE
    assert set(FSDP2_INTERNALS) == {
        "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
        "FSDPState._state_ctx.all_states",
        "FSDPState._state_ctx.post_backward_final_callback_queued",
        "FSDPState._training_state",
        "torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState.IDLE",
    }


@pytest.mark.parametrize("separate", [True, False])
def test_backwards_inside_an_fsdp2_backward(one_process, separate):
    """Two forward-and-backward passes run from a node inside the model's forward: with `separate_backward` the
    sharded gradients are those of the two passes on the unsharded model; without it, the second pass's gradients of
    the inner FSDP2 module are never reduced (FSDP2 takes its forward for an activation checkpoint's recompute)."""
    net, reference = _sharded()
    chunks = [torch.randn(3, 4), torch.randn(5, 4)]
    net(None, chunks=chunks, separate=separate).backward()
    for x in chunks:
        reference(x).sum().backward()
    wrong = []  # a gradient FSDP2 did not reduce into its sharded parameter, or a wrong one
    for (name, got), want in zip(net.named_parameters(), reference.parameters()):
        reduced = got.grad.full_tensor() if hasattr(got.grad, "full_tensor") else None
        if reduced is None or not torch.allclose(reduced, want.grad, atol=1e-6):
            wrong.append(name)
    if separate:
        assert wrong == []
    else:
        assert wrong and all(name.startswith("inner.") for name in wrong)


def test_outside_a_backward_it_changes_nothing(one_process):
    """No FSDP2 backward under way (prefix reuse called outside the model's forward, as GRPO does): a no-op."""
    net, reference = _sharded()
    context = net._get_fsdp_state()._state_ctx
    x = torch.randn(3, 4)
    with separate_backward(net):
        assert context.post_backward_final_callback_queued is False
        net(x).sum().backward()
    assert context.post_backward_final_callback_queued is False
    reference(x).sum().backward()
    for got, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad)
    with separate_backward(torch.nn.Linear(2, 2)):  # nothing sharded
        pass


def test_a_torch_without_them_is_refused(one_process, monkeypatch):
    """A torch whose FSDP2 state lacks what the seam reads: refused, naming the versions it was read in."""
    net, _ = _sharded()
    monkeypatch.setattr(type(net), "_get_fsdp_state", lambda self: object(), raising=False)
    refused = pytest.raises(NotImplementedError, match=r"FSDP2 internals that torch .* lacks .* read in torch 2\.11")
    with refused, separate_backward(net):
        pass
    assert fsdp2_compat._state_context(torch.nn.Linear(2, 2)) is None
