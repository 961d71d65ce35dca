"""The advantage-weighted token loss (torch)."""

from __future__ import annotations

from typing import Any

import torch

from hcapo_store.rendering.token_format import IGNORE_INDEX

NORMALIZE = ("tokens", "weights")


def weighted_nll(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    *,
    normalize: str = "tokens",
    num_items: Any = None,
) -> torch.Tensor:
    """``sum_t A_t * NLL_t`` over trained tokens (label != -100), divided by

    - ``tokens``: the number of trained tokens (``num_items`` when given: the count over an
      accumulated batch, as the transformers Trainer passes it) — right for signed
      advantages (``--variant paper``);
    - ``weights``: the sum of the advantages over trained tokens, at least 1, as the original
      ``train_hcapo.py`` does (its ``clamp(min=1)``: a micro-batch whose weights sum below 1 is
      divided by 1, not by the sum); non-negative advantages only.

    Token t is predicted from position t − 1, so logits, labels and advantages are shifted.
    """
    logits, labels, adv = logits[:, :-1], labels[:, 1:], advantages[:, 1:].to(torch.float32)
    trained = labels != IGNORE_INDEX
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(adv)
    total = (nll * adv * trained).sum()
    if normalize == "tokens":
        denominator = num_items if num_items is not None else trained.sum()
    elif normalize == "weights":
        if bool((adv[trained] < 0).any()):
            raise ValueError("normalize='weights' needs non-negative advantages: use normalize='tokens'")
        denominator = (adv * trained).sum()
    else:
        raise ValueError(f"normalize must be one of {NORMALIZE}, not {normalize!r}")
    if torch.is_tensor(denominator):
        return total / denominator.to(total.device).clamp(min=1)
    return total / max(float(denominator), 1.0)
