"""``calibrate.training.loss.distillation_loss``: the one loss every trainer and online adaptation descend.

float64 throughout; tolerance 1e-12 on values of O(1) to O(10) (sums of a few hundred terms: rounding
~1e-14), far below any real difference.
"""

from __future__ import annotations

import pytest
import torch

from calibrate.training.loss import distillation_loss


def _laws(seed: int, rows: int = 7, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    p = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, -1)
    return logits, p


@pytest.mark.parametrize("seed", [0, 1])
def test_it_is_the_forward_kl_plus_the_teachers_entropy_with_the_kls_gradient(seed):
    logits, p = _laws(seed)
    x = logits.clone().requires_grad_(True)
    loss = distillation_loss(x, p)
    log_q = torch.log_softmax(logits, -1)
    kl, entropy = (p * (p.log() - log_q)).sum(-1), -(p * p.log()).sum(-1)
    torch.testing.assert_close(loss, kl + entropy, rtol=0, atol=1e-12)
    loss.sum().backward()
    torch.testing.assert_close(x.grad, torch.softmax(logits, -1) - p, rtol=0, atol=1e-12)  # d KL / d logits


def test_a_top_k_teacher_over_its_token_ids_is_the_full_law_with_zeros_elsewhere():
    logits, p = _laws(2)
    top = p.topk(5, -1)
    law = top.values / top.values.sum(-1, keepdim=True)
    full = torch.zeros_like(p).scatter(-1, top.indices, law)
    torch.testing.assert_close(distillation_loss(logits, law, top.indices), distillation_loss(logits, full),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(distillation_loss(logits, law, top.indices, "sum"),
                               distillation_loss(logits, full).sum(), rtol=0, atol=1e-12)
    assert (distillation_loss(logits, law, top.indices) - distillation_loss(logits, p)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="reduction 'mean'"):
        distillation_loss(logits, p, reduction="mean")
