"""Cross-entropy over a large vocabulary without its [tokens x vocabulary] logits.

A decoder's loss over SigLIP 2's 256k-token vocabulary (Gemma's) would hold, for every token of
the batch, a row of 256,000 fp32 logits and their log-softmax for the backward: a gigabyte per
thousand tokens, at least twice. :func:`chunked_cross_entropy` takes what the logits are made of
instead (the decoder's last states, the vocabulary map's weight and bias:
:class:`vltrain.types.Readout`), makes the logits of ``chunk`` tokens at a time and keeps of them
only each token's log-sum-exp; the backward makes each chunk's logits again to form its gradient.
Beyond the inputs and the weight's gradient, the peak is then a chunk's logits, at the price of one
more vocabulary matmul per token (forward, recomputation, the two gradients: four, against three).

Only tokens with a label (not -100) are scored, so only their rows are gathered and multiplied:
padding positions cost nothing. The values are ``F.cross_entropy``'s with ``ignore_index=-100``,
``reduction="none"`` and ``label_smoothing``, computed in at least fp32
(:func:`vltrain.runtime.precision.at_least_fp32`), the matmuls too, whatever the autocast dtype
(under bf16 autocast the unchunked path makes its logits in bf16 and then upcasts them: the two
differ there by bf16's rounding of the logits). The gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vltrain.runtime.precision import at_least_fp32

IGNORE = -100


def _upcast(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else at_least_fp32(t) for t in tensors]


def _forward_chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, labels: torch.Tensor, smoothing: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, log-sum-exp) of some rows; their logits are freed on return."""
    z = F.linear(h, w, b)
    lse = torch.logsumexp(z, dim=1)
    nll = lse - z.gather(1, labels[:, None]).squeeze(1)
    if smoothing:  # F.cross_entropy's: (1 - s) x NLL + s x the vocabulary's mean of -log p
        nll = (1 - smoothing) * nll + smoothing * (lse - z.mean(dim=1))
    return nll, lse


def _backward_chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, labels: torch.Tensor,
                    lse: torch.Tensor, grad: torch.Tensor, smoothing: float, grad_w: torch.Tensor,
                    grad_b: torch.Tensor | None) -> torch.Tensor:
    """Adds some rows' share to ``grad_w`` (and ``grad_b``) and returns their states' gradient: the
    logits' gradient, softmax - (1 - s) one-hot - s / V, made in place of their logits (freed on return)."""
    d = F.linear(h, w, b).sub_(lse[:, None]).exp_()
    if smoothing:
        d.sub_(smoothing / w.shape[0])
    d.scatter_add_(1, labels[:, None], d.new_full((len(d), 1), smoothing - 1))
    d.mul_(grad[:, None].to(d.dtype))
    grad_w.addmm_(d.t(), h)
    if grad_b is not None:
        grad_b.add_(d.sum(dim=0))
    return d @ w


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [N] of ``hidden`` [N, W] (every row labelled) against ``labels`` [N]
    through logits ``hidden @ weight.T + bias``, made ``chunk`` rows at a time; saves the inputs and
    each row's log-sum-exp [N], and makes each chunk's logits again in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, smoothing: float, chunk: int):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = _upcast(hidden, weight, bias)
            loss, lse = h.new_empty(len(h)), h.new_empty(len(h))
            for start in range(0, len(h), chunk):
                rows = slice(start, start + chunk)
                loss[rows], lse[rows] = _forward_chunk(h[rows], w, b, labels[rows], smoothing)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.smoothing, ctx.chunk = smoothing, chunk
        return loss

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = _upcast(hidden, weight, bias)
            grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
            grad_b = None if b is None else torch.zeros_like(b)
            for start in range(0, len(h), ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                grad_h[rows] = _backward_chunk(h[rows], w, b, labels[rows], lse[rows], grad[rows], ctx.smoothing,
                                               grad_w, grad_b)
        return (grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None if bias is None else grad_b.to(bias.dtype),
                None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, label_smoothing: float = 0.0, chunk: int = 1024) -> torch.Tensor:
    """Each token's cross-entropy [...] (0 where its label is -100) of its states ``hidden`` [..., W]
    through the logits ``hidden @ weight.T + bias`` (``weight`` [V, W], ``bias`` [V] or None)
    against ``labels`` [...], as ``F.cross_entropy(logits, labels, ignore_index=-100,
    reduction="none", label_smoothing=...)`` gives it, in at least fp32; the logits of at most
    ``chunk`` labelled tokens exist at a time. One host synchronization: the count of labelled tokens.

    With no token labelled, the loss is zeros and the gradient of ``weight`` (and ``bias``) zeros,
    not None: the parameters stay in the graph."""
    flat = labels.reshape(-1)
    index = (flat != IGNORE).nonzero().squeeze(1)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    ce = ChunkedCrossEntropy.apply(picked, weight, bias, flat.index_select(0, index), label_smoothing, chunk)
    return ce.new_zeros(len(flat)).index_copy(0, index, ce).view(labels.shape)
