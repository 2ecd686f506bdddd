"""Distillation losses: a CLIP or SigLIP student learns the teacher's image-text similarities.

The teacher's embeddings of the batch's rows come with the rows (``Rows.teacher``, a
:class:`~vltrain.types.TeacherEmbeds`); its width may differ from the student's, since only the
two similarity matrices, each N x N over the global batch, are compared.

**Softmax (CLIP students)**, :func:`distill_loss`: OpenCLIP's ``DistillClipLoss``
(``src/open_clip/loss.py`` of open_clip 3.3), its distillation term. With student logits
``s = exp(logit_scale) * img @ txt.T`` (the scale clamped at 100, as
:func:`~vltrain.objectives.losses.scale_of` does) and teacher logits
``t = teacher.scale * timg @ ttxt.T``, each row i scores, in both directions (image to text on
``s``, text to image on ``s.T``),

    l_i = -sum_j softmax(t_i)_j * log_softmax(s_i)_j

and the loss is the mean of the two directions, averaged over the rows (a teacher's SigLIP bias
shifts a whole row, which a softmax ignores, so it is left out). This is a cross-entropy
against the teacher's distribution, not a KL divergence: it exceeds the KL by the teacher's
entropy, a constant for the student, so the gradients are the same.

**Sigmoid (SigLIP students)**, :func:`distill_sigmoid_loss`: Hinton et al. (2015)'s soft-target
cross-entropy ("Distilling the Knowledge in a Neural Network") written for SigLIP's independent
per-pair binary decisions. With ``s_ij = exp(logit_scale) * img_i . txt_j + logit_bias`` and
``t_ij = teacher.scale * timg_i . ttxt_j + teacher.bias``, each pair is a binary cross-entropy
against the teacher's probability of a match as a soft label,

    l_ij = -[sigmoid(t_ij) * logsigmoid(s_ij) + (1 - sigmoid(t_ij)) * logsigmoid(-s_ij)]

summed over a row's columns and normalized by the number of images, as SigLIP's loss is. Again a
plain cross-entropy (the teacher's own entropy is not subtracted); its gradient in ``s_ij`` is
``sigmoid(s_ij) - sigmoid(t_ij)``, zero where the student's logits equal the teacher's.

Both follow :mod:`vltrain.objectives.losses`: each rank scores its own rows against every rank's
columns (the student's gathered with a gradient path, the teacher's without), returns ``world``
times its share of the global loss, keeps only rows with both an image and a text (as rows and as
columns), weighs them by ``rows.row_weights``, and computes in fp32. A column with the row's sample
id that is not the row's own position (the same sample seen twice) takes no part in the row.
``teacher.scale`` is the teacher's inverse temperature as given: already exp'd, not clamped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vltrain.objectives.losses import GlobalBatch, _row_weights, masked, scale_of
from vltrain.runtime.distributed import all_gather_no_grad, all_gather_with_grad
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import Rows


def _excluded(ids: torch.Tensor, g: GlobalBatch) -> torch.Tensor:
    """[b, N] bool: the columns a row leaves out: invalid ones, and its sample id elsewhere than at its
    own position (a row without both sides leaves out every column, its own included)."""
    b = ids.shape[0]
    own = torch.zeros(b, g.ids.shape[0], dtype=torch.bool, device=ids.device)
    own[torch.arange(b, device=ids.device), torch.arange(b, device=ids.device) + g.offset] = True
    return ((ids[:, None] == g.ids[None, :]) & ~own) | ~g.valid[None, :]


def _teacher_logits(scale: torch.Tensor, bias: torch.Tensor | None, left: torch.Tensor, right: torch.Tensor
                    ) -> torch.Tensor:
    """The teacher's logits: a target, so without a gradient path."""
    with torch.no_grad():
        logits = at_least_fp32(scale) * at_least_fp32(left) @ at_least_fp32(right).t()
        return logits if bias is None else logits + at_least_fp32(bias)


def _soft_cross_entropy(teacher: torch.Tensor, student: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """[b] -sum_j softmax(teacher)_j log_softmax(student)_j over the columns not excluded."""
    p = masked(teacher, excluded).softmax(dim=1).masked_fill(excluded, 0.0)
    log_q = masked(student, excluded).log_softmax(dim=1)
    return -(p * log_q).sum(dim=1)


def distill_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    rows: Rows,
    rows_out: list | None = None,
) -> torch.Tensor:
    """OpenCLIP's softmax distillation (module docstring) over the global batch: the student's
    L2-normalized [B, D] embeddings against ``rows.teacher``'s. ``rows_out`` receives each row's
    unweighted loss (detached)."""
    teacher = rows.teacher
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w, image_embeds, text_embeds, teacher.image, teacher.text)
    all_images = all_gather_with_grad(at_least_fp32(image_embeds), g.shapes[0])
    all_texts = all_gather_with_grad(at_least_fp32(text_embeds), g.shapes[1])
    teacher_images = all_gather_no_grad(at_least_fp32(teacher.image), g.shapes[2])
    teacher_texts = all_gather_no_grad(at_least_fp32(teacher.text), g.shapes[3])
    excluded = _excluded(ids, g)
    scale = scale_of(logit_scale)
    i2t = _soft_cross_entropy(_teacher_logits(teacher.scale, None, teacher.image, teacher_texts),
                              scale * at_least_fp32(image_embeds) @ all_texts.t(), excluded)
    t2i = _soft_cross_entropy(_teacher_logits(teacher.scale, None, teacher.text, teacher_images),
                              scale * at_least_fp32(text_embeds) @ all_images.t(), excluded)
    per_row = (i2t + t2i) / 2
    if rows_out is not None:
        rows_out.append(per_row.detach())
    return g.normalize((w * per_row).sum())


def distill_sigmoid_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None,
    rows: Rows,
    rows_out: list | None = None,
) -> torch.Tensor:
    """Soft-target sigmoid distillation (module docstring): every (image, text) pair of the global
    batch is a binary cross-entropy against the teacher's probability of a match, counted once (each
    rank scores its images against all texts). ``rows_out`` receives each row's unweighted loss."""
    teacher = rows.teacher
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w, text_embeds, teacher.text)
    all_texts = all_gather_with_grad(at_least_fp32(text_embeds), g.shapes[0])
    teacher_texts = all_gather_no_grad(at_least_fp32(teacher.text), g.shapes[1])
    student = scale_of(logit_scale) * at_least_fp32(image_embeds) @ all_texts.t()
    if logit_bias is not None:
        student = student + at_least_fp32(logit_bias)
    p = torch.sigmoid(_teacher_logits(teacher.scale, teacher.bias, teacher.image, teacher_texts))
    pairs = -(p * F.logsigmoid(student) + (1 - p) * F.logsigmoid(-student))
    per_row = pairs.masked_fill(_excluded(ids, g), 0.0).sum(dim=1)
    if rows_out is not None:
        rows_out.append(per_row.detach())
    return g.normalize((w * per_row).sum())
