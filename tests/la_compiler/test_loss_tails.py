"""A ``laqat::cross_entropy`` with ``inplace_backward=True`` on a linear layer's logits runs outside the compiled graph
(la_compiler/hand_off/loss_tails.py): under both hand-offs the loss and every gradient are an fp64 eager copy's, the
logits hold their gradient after the backward (FLA's in-place backward), a term the caller adds on the returned
logits still gets the right gradient, and no tail is split where it must not be (the flag off, another reader of the
logits inside the graph, a head below the ratio)."""
from __future__ import annotations

import warnings

import pytest
import torch

import la_compiler  # noqa: F401  (registers the backend)
from la_compiler.hand_off.linear_outputs import MIN_RATIO

VOCAB, HIDDEN, IGNORE = 96, 8, -100


class TinyLM(torch.nn.Module):
    """A head and FLA's fused loss as FusedCrossEntropyLoss.forward computes it (mean over the tokens not
    ignored); ``inplace`` is FLA's inplace_backward, ``logit_term`` a second reader of the logits in the graph."""
    def __init__(self, inplace=True, logit_term=False, vocab=VOCAB):
        super().__init__()
        self.inplace, self.logit_term = inplace, logit_term
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, vocab, bias=True)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.body(self.emb(ids))))
        target = labels.reshape(-1)
        loss, _, _ = torch.ops.laqat.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, 0.1, 1.0, 1e-4,
                                                   None, IGNORE, self.inplace)
        loss = loss.sum() / (target != IGNORE).sum()
        if self.logit_term:
            loss = loss + 1e-2 * logits.float().square().mean()
        return loss, logits


def reference_loss(model, ids, labels):
    """The same loss in fp64 torch: label smoothing 0.1, z-loss 1e-4 lse^2, the ignored tokens left out."""
    logits = model.head(torch.tanh(model.body(model.emb(ids))))
    z, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    valid = target != IGNORE
    lse = torch.logsumexp(z, -1)
    z_target = z.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    per_token = lse - 0.9 * z_target - 0.1 * z.mean(-1) + 1e-4 * lse * lse
    loss = torch.where(valid, per_token, 0.0).sum() / valid.sum()
    if model.logit_term:
        loss = loss + 1e-2 * logits.square().mean()
    return loss, logits


def _pair(**kwargs):
    torch.manual_seed(0)
    model = TinyLM(**kwargs)
    reference = TinyLM(**kwargs).double()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _batch():
    ids, labels = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, MIN_RATIO * HIDDEN - 1, (2, 9))
    labels[0, 2] = IGNORE
    return ids, labels


def _run(model, compiler, ids, labels):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing to rewrite in this model
        fn = torch.compile(model, backend="laqat", options={"compiler": compiler})
        return fn(ids, labels)


def _check_grads(model, reference):
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p_ref.grad.abs().max() > 1e-4, name
        torch.testing.assert_close(p.grad.double(), p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_the_loss_runs_outside_and_overwrites_the_logits_with_their_gradient(compiler):
    assert MIN_RATIO * HIDDEN <= VOCAB
    model, reference = _pair()
    ids, labels = _batch()
    loss, logits = _run(model, compiler, ids, labels)
    assert type(logits.grad_fn).__name__ == "LinearOutputFunctionBackward"
    assert type(loss.grad_fn).__name__ == "DivBackward0"  # the tail's reduction, run eagerly
    ref_loss, ref_logits = reference_loss(reference, ids, labels)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.detach().double(), ref_logits.detach(), rtol=1e-5, atol=1e-6)
    ref_logits.retain_grad()
    loss.backward()
    ref_loss.backward()
    _check_grads(model, reference)
    # FLA's in-place backward: the returned logits now hold their gradient
    torch.testing.assert_close(logits.detach().double(), ref_logits.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_a_term_on_the_returned_logits_gets_its_gradient(compiler):
    """The caller's term reads the logits before the loss's backward overwrites them (autograd runs the later
    node's backward first)."""
    model, reference = _pair()
    ids, labels = _batch()
    weights = torch.randn(2, 9, VOCAB)
    loss, logits = _run(model, compiler, ids, labels)
    (loss + (logits.square() * weights).sum() * 1e-2).backward()
    ref_loss, ref_logits = reference_loss(reference, ids, labels)
    (ref_loss + (ref_logits.square() * weights.double()).sum() * 1e-2).backward()
    _check_grads(model, reference)


@pytest.mark.parametrize("kwargs", [dict(inplace=False), dict(logit_term=True), dict(vocab=MIN_RATIO * HIDDEN - 1)],
                         ids=["flag-off", "another-reader", "below-ratio"])
def test_no_tail_where_the_logits_must_stay(kwargs):
    """The flag off, the logits read by another op of the graph, a head below the ratio: the loss stays in the
    graph, the logits keep their values after the backward, and the gradients are eager's."""
    model, reference = _pair(**kwargs)
    ids, labels = _batch()
    loss, logits = _run(model, "inductor", ids, labels)
    assert type(loss.grad_fn).__name__ != "DivBackward0"
    before = logits.detach().clone()
    loss.backward()
    assert torch.equal(logits.detach(), before)
    ref_loss, _ = reference_loss(reference, ids, labels)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    ref_loss.backward()
    _check_grads(model, reference)


def test_without_gradients_the_tail_only_computes_the_loss():
    model, reference = _pair()
    ids, labels = _batch()
    with torch.no_grad():
        loss, logits = _run(model, "inductor", ids, labels)
        ref_loss, ref_logits = reference_loss(reference, ids, labels)
    assert logits.grad_fn is None and loss.grad_fn is None
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
