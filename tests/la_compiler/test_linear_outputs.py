"""The Inductor hand-off returns a large output of a linear layer through its own autograd node
(la_compiler/hand_off/linear_outputs.py): no zero gradient of the logits' size in the backward of a loss that does
not use them, the same values and gradients as eager (the loss alone, and the loss with a term on the logits),
and the outputs that do not qualify (a linear not larger than its input by the ratio, an output that is no linear)
stay the compiled graph's."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import la_compiler  # noqa: F401  (registers the backend)
from la_compiler.hand_off.linear_outputs import MIN_RATIO

VOCAB, HIDDEN, SMALL = 96, 8, 12  # the head is 12x its input, the side output 1.5x (below MIN_RATIO)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
        self.side = torch.nn.Linear(HIDDEN, SMALL, bias=False)

    def forward(self, ids, labels):
        h = torch.tanh(self.body(self.emb(ids)))
        logits = self.head(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return loss, logits, self.side(h), h * 2


class ZerosOfShape(TorchDispatchMode):
    """Records the aten.zeros* calls that create a tensor of one of ``shapes``."""
    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "zeros" in str(func) and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.seen.append((str(func), tuple(out.shape)))
        return out


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def compiled():
    assert SMALL < MIN_RATIO * HIDDEN <= VOCAB
    torch.manual_seed(0)
    model = TinyLM()
    reference = TinyLM().double()
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing to rewrite in this model
        fn = torch.compile(model, backend="laqat", options={"compiler": "inductor"})
        ids, labels = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 9))
        fn(ids, labels)
    return model, reference, fn


def test_the_logits_come_back_through_their_own_node_and_no_zero_gradient_is_made(compiled):
    model, reference, fn = compiled
    ids, labels = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 9))
    model.zero_grad(set_to_none=True)
    loss, logits, side, h2 = fn(ids, labels)
    assert type(logits.grad_fn).__name__ == "LinearOutputFunctionBackward"
    assert not logits._is_view()  # in-place ops on it stay allowed, as on the compiled graph's outputs
    assert type(side.grad_fn).__name__ != "LinearOutputFunctionBackward"  # 1.5x its input: stays the graph's
    assert type(h2.grad_fn).__name__ != "LinearOutputFunctionBackward"  # not a linear
    with ZerosOfShape({(2, 9, VOCAB), (18, VOCAB)}) as mode:
        loss.backward()
    assert mode.seen == []
    ref_loss, ref_logits, ref_side, _ = reference(ids, labels)
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.detach().double(), ref_logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(side.detach().double(), ref_side.detach(), rtol=1e-5, atol=1e-6)
    got, want = _grads(model), {n: p.grad for n, p in reference.named_parameters()}
    for name in want:
        if name.startswith("side"):
            assert not got[name].any()  # the loss does not reach it
        else:
            torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-6, msg=name)
    reference.zero_grad(set_to_none=True)


def test_a_gradient_on_the_logits_flows_as_the_linear_layers(compiled):
    model, reference, fn = compiled
    ids, labels = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 9))
    weights = torch.randn(2, 9, VOCAB)
    side_weights = torch.randn(2, 9, SMALL)
    model.zero_grad(set_to_none=True)
    loss, logits, side, _ = fn(ids, labels)
    (loss + (logits * weights).sum() + (side * side_weights).sum()).backward()
    reference.zero_grad(set_to_none=True)
    ref_loss, ref_logits, ref_side, _ = reference(ids, labels)
    (ref_loss + (ref_logits * weights.double()).sum() + (ref_side * side_weights.double()).sum()).backward()
    got = _grads(model)
    for name, p in reference.named_parameters():
        assert p.grad.abs().max() > 1e-3, name
        torch.testing.assert_close(got[name].double(), p.grad, rtol=1e-4, atol=1e-5, msg=name)
    reference.zero_grad(set_to_none=True)


def test_without_gradients_the_outputs_are_plain(compiled):
    model, reference, fn = compiled
    ids, labels = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        loss, logits, _, _ = fn(ids, labels)
        ref_loss, ref_logits, _, _ = reference(ids, labels)
    assert logits.grad_fn is None and not logits.requires_grad
    torch.testing.assert_close(logits.double(), ref_logits, rtol=1e-5, atol=1e-6)
