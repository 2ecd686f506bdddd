"""ITC and SigLIP computed around a ring of ranks: exact, with memory that does not grow with W.

``losses.itc_loss`` gathers every rank's embeddings (``[W*b, D]``) and scores this rank's b rows
against all of them at once (``[b, W*b]`` logits, kept for the backward), which grows with W
until it runs a rank out of memory. Here the column blocks travel instead: each rank holds one
other rank's block at a time (padded to the largest local batch, so every pass has one shape),
scores its rows against it, passes it on to the next rank, and keeps only per-row running
statistics (ITC: an online log-sum-exp per row and direction; SigLIP: a running sum). The backward
goes around the ring again, recomputing each block; the gradient of the visiting block's columns
travels with it and, one pass after the last block, reaches the rank that owns them, holding every
rank's contribution (what the all-reduce of a gathered gradient gives). Saved for the backward:
this rank's own rows and a few numbers per row, whatever W.

The cost is communication in turns rather than at once: W - 1 passes of a block forward and W in
the backward (the last one carries only gradients home), with a block's arithmetic between passes
(memory and bytes against gathering: ``docs/benchmarks/cpu-training.md#communication-per-step``). Values and
gradients equal ``losses.itc_loss`` and ``losses.siglip_loss`` up to the order of floating-point
sums (``tests/test_ring.py``); select it with ``model.loss.contrastive_impl: ring``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vltrain.objectives.losses import GlobalBatch, _row_weights, masked, scale_of
from vltrain.runtime.distributed import issue, world_info
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import Rows


def ring_pass(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send each tensor to the next rank and receive the previous rank's (same shapes everywhere)."""
    rank, world = world_info()
    if world == 1:
        return tensors
    out = []
    for t in tensors:
        t = t.contiguous()
        got = torch.empty_like(t)

        def run(t: torch.Tensor = t, got: torch.Tensor = got) -> None:
            ops = [dist.P2POp(dist.isend, t, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        issue("ring_pass", t, run, sent=t.numel() * t.element_size())
        out.append(got)
    return out


def _pad_rows(x: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])


def _excluded(ids: torch.Tensor, col_ids: torch.Tensor, col_valid: torch.Tensor, own: bool) -> torch.Tensor:
    """Columns that are no negative for the row: same sample id, or no pair; the row's own positive stays."""
    excluded = (ids[:, None] == col_ids[None, :]) | ~col_valid[None, :]
    if own:
        b = ids.shape[0]
        excluded[torch.arange(b, device=ids.device), torch.arange(b, device=ids.device)] = False
    return excluded


def _online_lse(m: torch.Tensor, s: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Running (max, sum of exp(x - max)) per row, updated with a block of ``logits``."""
    new = torch.maximum(m, logits.amax(dim=1))
    return new, s * (m - new).exp() + (logits - new[:, None]).exp().sum(dim=1)


class _RingITC(torch.autograd.Function):
    """Both InfoNCE directions of this rank's rows against every rank's columns, block by block."""

    @staticmethod
    def forward(ctx, img, txt, scale, ids, valid, coef, big, rows_out):  # type: ignore[override]
        rank, world = world_info()
        b = ids.shape[0]
        cols = [_pad_rows(img, big), _pad_rows(txt, big), _pad_rows(ids, big, -1), _pad_rows(valid, big, False)]
        stats = [torch.full((b,), float("-inf"), device=img.device), img.new_zeros(b)] * 2
        for k in range(world):
            c_img, c_txt, c_ids, c_valid = cols
            excluded = _excluded(ids, c_ids, c_valid, own=k == 0)
            i2t = masked(scale * img @ c_txt.t(), excluded)
            t2i = masked(scale * txt @ c_img.t(), excluded)
            stats = [*_online_lse(stats[0], stats[1], i2t), *_online_lse(stats[2], stats[3], t2i)]
            if k < world - 1:
                cols = ring_pass(cols)
        lse_i2t, lse_t2i = stats[0] + stats[1].log(), stats[2] + stats[3].log()
        positive = scale * (img * txt).sum(dim=1)
        if rows_out is not None:
            rows_out.append((lse_i2t - positive + lse_t2i - positive).detach() / 2)
        ctx.save_for_backward(img, txt, scale, ids, valid, coef, lse_i2t, lse_t2i)
        ctx.big = big
        return (coef * (lse_i2t - positive + lse_t2i - positive)).sum()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        img, txt, scale, ids, valid, coef, lse_i2t, lse_t2i = ctx.saved_tensors
        rank, world = world_info()
        b, big = ids.shape[0], ctx.big
        weight = (coef * grad)[:, None]
        g_img, g_txt, g_scale = torch.zeros_like(img), torch.zeros_like(txt), scale.new_zeros(())
        cols = [_pad_rows(img, big), _pad_rows(txt, big), _pad_rows(ids, big, -1), _pad_rows(valid, big, False)]
        acc = [img.new_zeros(big, img.shape[1]), txt.new_zeros(big, txt.shape[1])]  # the columns' gradients
        for k in range(world):
            c_img, c_txt, c_ids, c_valid = cols
            excluded = _excluded(ids, c_ids, c_valid, own=k == 0)
            for rows, c_rows, lse, g_rows, a in ((img, c_txt, lse_i2t, g_img, 1), (txt, c_img, lse_t2i, g_txt, 0)):
                dots = rows @ c_rows.t()
                p = (masked(scale * dots, excluded) - lse[:, None]).exp()
                if k == 0:
                    diagonal = torch.arange(b, device=p.device)
                    p[diagonal, diagonal] -= 1.0  # the positive's target
                g = (weight * p).masked_fill(excluded, 0.0)
                g_rows += scale * g @ c_rows
                acc[a] += scale * g.t() @ rows
                g_scale += (g * dots).sum()
            if k < world - 1:
                *cols, acc[0], acc[1] = ring_pass([*cols, *acc])
        home = ring_pass(acc)  # the last holder sends the gradients to their owner
        return g_img + home[0][:b], g_txt + home[1][:b], g_scale, None, None, None, None, None


class _RingSigLIP(torch.autograd.Function):
    """This rank's images against every rank's texts, block by block, each pair a binary decision."""

    @staticmethod
    def forward(ctx, img, txt, scale, bias, ids, valid, coef, big, rows_out):  # type: ignore[override]
        world = world_info()[1]
        cols = [_pad_rows(txt, big), _pad_rows(ids, big, -1), _pad_rows(valid, big, False)]
        total = img.new_zeros(())
        per_row = img.new_zeros(ids.shape[0])
        for k in range(world):
            c_txt, c_ids, c_valid = cols
            logits = scale * img @ c_txt.t() + bias
            labels = (ids[:, None] == c_ids[None, :]).float() * 2 - 1
            pair_losses = F.logsigmoid(labels * logits) * c_valid[None, :].float()  # x 0/1: exact either order
            total = total - (coef[:, None] * pair_losses).sum()
            per_row -= pair_losses.sum(dim=1)
            if k < world - 1:
                cols = ring_pass(cols)
        if rows_out is not None:
            rows_out.append(per_row)
        ctx.save_for_backward(img, txt, scale, bias, ids, valid, coef)
        ctx.big = big
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        img, txt, scale, bias, ids, valid, coef = ctx.saved_tensors
        world, big = world_info()[1], ctx.big
        g_img, g_scale, g_bias = torch.zeros_like(img), scale.new_zeros(()), bias.new_zeros(())
        cols = [_pad_rows(txt, big), _pad_rows(ids, big, -1), _pad_rows(valid, big, False)]
        acc = txt.new_zeros(big, txt.shape[1])
        for k in range(world):
            c_txt, c_ids, c_valid = cols
            dots = img @ c_txt.t()
            labels = (ids[:, None] == c_ids[None, :]).float() * 2 - 1
            # d/dx of -logsigmoid(y x) is -y sigmoid(-y x)
            g = -(coef * grad)[:, None] * labels * torch.sigmoid(-labels * (scale * dots + bias)) * c_valid[None, :].float()
            g_img += scale * g @ c_txt
            acc += scale * g.t() @ img
            g_scale += (g * dots).sum()
            g_bias += g.sum()
            if k < world - 1:
                *cols, acc = ring_pass([*cols, acc])
        (home,) = ring_pass([acc])
        return g_img, home[: ids.shape[0]], g_scale, g_bias, None, None, None, None, None


def itc_loss_ring(image_embeds, text_embeds, logit_scale, rows: Rows, rows_out: list | None = None) -> torch.Tensor:
    """``losses.itc_loss`` computed around the ring (same arguments, value and gradients)."""
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w)
    total = torch.where(g.weight_total > 0, g.weight_total, torch.ones_like(g.weight_total))
    coef = w * g.world / total / 2
    return _RingITC.apply(at_least_fp32(image_embeds), at_least_fp32(text_embeds), scale_of(logit_scale), ids, valid, coef,
                          max(g.sizes), rows_out)


def siglip_loss_ring(image_embeds, text_embeds, logit_scale, logit_bias, rows: Rows,
                     rows_out: list | None = None) -> torch.Tensor:
    """``losses.siglip_loss`` computed around the ring (same arguments, value and gradients)."""
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w)
    total = torch.where(g.weight_total > 0, g.weight_total, torch.ones_like(g.weight_total))
    coef = w * g.world / total
    image_embeds, text_embeds = at_least_fp32(image_embeds), at_least_fp32(text_embeds)
    bias = at_least_fp32(logit_bias) if logit_bias is not None else image_embeds.new_zeros(())
    return _RingSigLIP.apply(image_embeds, text_embeds, scale_of(logit_scale), bias, ids, valid, coef, max(g.sizes),
                             rows_out)
