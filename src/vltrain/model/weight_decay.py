"""Which parameters take no weight decay: a model's ``no_weight_decay`` starts from these."""

from __future__ import annotations

from torch import nn

NO_WEIGHT_DECAY = ("token_embedding", "pos_embed", "position", "cls_token", "logit_scale", "logit_bias",
                   "embeddings")
"""Parameter names (substrings) that take no weight decay, besides every parameter of fewer than 2
dimensions (biases, gains) and every embedding or norm module's parameters."""

_NORMS_AND_EMBEDDINGS = (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d)


def default_no_weight_decay(model: nn.Module) -> set[str]:
    """Norms, biases, embeddings, positions, class tokens and the temperature/bias scalars.

    Weight decay pulls weights towards zero: a regulariser for matrices, but only harm for these
    (decaying ``logit_scale`` quietly raises the temperature every step)."""
    names = {n for n, p in model.named_parameters() if p.ndim < 2 or any(s in n for s in NO_WEIGHT_DECAY)}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, _NORMS_AND_EMBEDDINGS):
            names.update(f"{mod_name}.{p}" if mod_name else p for p, _ in mod.named_parameters(recurse=False))
    return names
