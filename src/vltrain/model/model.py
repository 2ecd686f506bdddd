"""The vision-language model: given its towers, projections and heads, it encodes.

Scoring is not the model's: :mod:`vltrain.objectives.scoring` takes what ``encode`` returns and, for
ITM, MLM and MIM, runs the passes this model offers (``itm_logits``, ``mlm_logits``,
``text_mlm_logits``, ``mim_prediction``: the :class:`vltrain.types.ModelPasses` protocol) on the
inputs it chose; :class:`vltrain.compose.task.Task` composes the two into what data parallelism wraps.

Every rank runs the same graph whatever its batch holds. A tower whose modality is absent from the
whole local batch runs on one dummy row, and every tower output enters the loss through ``anchor``
(zero times its mean): each parameter then receives a gradient (zero where there was no data), so
DDP with ``find_unused_parameters=False`` and FSDP2's collectives match on every rank, and the
result is exactly that of skipping the tower. When some rows lack a modality, the tower runs only on
the rows that have it (one host synchronization per tower per step: the count of such rows).
No module uses dropout or other randomness in ``encode``, so replaying it (gradient caching) is exact.
"""

from __future__ import annotations

import torch
from torch import nn

from vltrain.model.decoder import CaptionDecoder, DecoderCache
from vltrain.model.fusion import FusionEncoder
from vltrain.model.heads import ITMHead, MIMHead, MLMHead, Projection
from vltrain.model.locca import LocCaDecoder
from vltrain.model.selfdist import SelfDistHeads
from vltrain.model.weight_decay import default_no_weight_decay
from vltrain.boxes import TaskRows
from vltrain.images import Images
from vltrain.types import Encoded, ModelInputs, ModelSpec, Readout, Tokens


class VLModel(nn.Module):
    """Vision and text towers with projections to a shared space, a learnable temperature (and SigLIP
    bias), for fusion models a fusion encoder with ITM and MLM heads, and for captioning models a
    decoder over the text tower's tokens; built by ``build_model``, which decides which parts exist."""

    def __init__(
        self,
        vision: nn.Module,
        text: nn.Module,
        image_proj: Projection,
        text_proj: Projection,
        *,
        logit_scale: float,
        logit_bias: float | None = None,
        fusion: FusionEncoder | None = None,
        itm_head: ITMHead | None = None,
        mlm_head: MLMHead | None = None,
        text_mlm_head: MLMHead | None = None,
        mim_head: MIMHead | None = None,
        decoder: CaptionDecoder | None = None,
        selfdist: SelfDistHeads | None = None,
        vocab_size: int,
        pad_id: int,
        mask_id: int | None = None,
        max_text_length: int,
    ):
        super().__init__()
        # the order of registration is the order of parameters (optimizer, gradient norm, checkpoints)
        self.vision = vision
        self.text = text
        self.image_proj = image_proj
        self.text_proj = text_proj
        self.logit_scale = nn.Parameter(torch.tensor(logit_scale))
        self.logit_bias = nn.Parameter(torch.tensor(logit_bias)) if logit_bias is not None else None
        self.fusion = fusion
        self.itm_head = itm_head
        self.mlm_head = mlm_head
        self.text_mlm_head = text_mlm_head
        self.mim_head = mim_head
        self.decoder = decoder
        self.selfdist = selfdist
        self.embed_dim = image_proj.embed_dim
        self.vocab_size, self.pad_id, self.mask_id = vocab_size, pad_id, mask_id
        self.max_text_length = max_text_length

    # -- encoding -----------------------------------------------------------------------------

    @property
    def reads_tokens(self) -> bool:
        """Whether a part reads the towers' tokens (the fusion encoder, the decoder): ``encode`` keeps them."""
        return self.fusion is not None or self.decoder is not None

    def _vision(self, images: Images) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(tokens, their mask of real ones or None: all real, embeddings) of images one to a row."""
        tokens, pooled = self.vision(images)
        return tokens.values, tokens.real, self.image_proj(pooled)

    def _packed_images(self, images: Images, has_image: torch.Tensor):
        """Packed images (``Images.layout`` packed): the tower runs on every packed sequence (one of padding
        when the batch has no image) and gives each row's tokens in a row of its own, as the padded
        layout does. Rows without an image get zero embeddings (no gradient) and, for the fusion
        encoder, zero tokens of which only the first is real, as :meth:`_encode_present` gives them."""
        tokens, pooled = self.vision(images)
        embeds = self.image_proj(pooled)
        anchor = 0.0 * (tokens.values.float().mean() + embeds.float().mean())
        embeds = torch.where(has_image[:, None], embeds, torch.zeros_like(embeds))
        if not self.reads_tokens:
            return None, None, embeds, anchor
        first = torch.zeros_like(tokens.real)
        first[:, 0] = True
        values = torch.where(has_image[:, None, None], tokens.values, torch.zeros_like(tokens.values))
        return values, torch.where(has_image[:, None], tokens.real, first), embeds, anchor

    def _text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        """(tokens, None, embeddings) of captions: their mask is ``attention_mask``, which the caller has."""
        tokens, pooled = self.text(input_ids, attention_mask)
        return tokens, None, self.text_proj(pooled)

    def _encode_present(self, fn, inputs: tuple, dummy: tuple, present: torch.Tensor, n: int | None):
        """Run ``fn`` on the rows where ``present`` (or on ``dummy`` when there is none); scatter the
        results back to the full batch with zero rows elsewhere. Returns (tokens | None, real | None,
        embeds, anchor): ``real`` the tower's mask of real tokens on its rows (None: all real), and on
        rows without the modality only the first (zero) token, so that attention over them has a key.

        ``n``, the number of present rows, comes from the host when the collator counted it: the
        rows are then found by a sort on the device, with no wait for it (``nonzero`` waits).
        """
        b = present.shape[0]
        if n is None:
            index = present.nonzero().squeeze(1)
            n = index.numel()
        elif 0 < n < b:
            # the present rows first, in order (a stable sort): the indices nonzero would give
            index = torch.sort((~present).to(torch.uint8), stable=True).indices[:n]
        if n == b:
            tokens, real, embeds = fn(*inputs)
        else:
            rows = (x.index_select(0, index) for x in inputs)
            tokens, real, embeds = fn(*(dummy if n == 0 else rows))
        anchor = 0.0 * (tokens.float().mean() + embeds.float().mean())
        if not self.reads_tokens:
            tokens = real = None
        if n == b:
            return tokens, real, embeds, anchor
        if n == 0:
            # zeros that stay in the graph: a later gather-with-grad must run its backward on every rank
            full_embeds = (0.0 * embeds[:1]).expand(b, -1)
            full_tokens = None if tokens is None else (0.0 * tokens[:1]).expand(b, *tokens.shape[1:])
        else:
            full_embeds = embeds.new_zeros(b, embeds.shape[1]).index_copy(0, index, embeds)
            full_tokens = (None if tokens is None
                           else tokens.new_zeros((b, *tokens.shape[1:])).index_copy(0, index, tokens))
        if real is not None:
            first = real.new_zeros(b, real.shape[1])
            first[:, 0] = True
            real = first if n == 0 else first.index_copy(0, index, real)
        return full_tokens, real, full_embeds, anchor

    def encode(self, inputs: ModelInputs) -> Encoded:
        images, input_ids, attention_mask = inputs.images, inputs.input_ids, inputs.attention_mask
        if images.layout == "packed":  # the tower runs on the sequences, whichever rows they hold
            image_tokens, real, image_embeds, a_img = self._packed_images(images, inputs.has_image)
        else:
            image_tokens, real, image_embeds, a_img = self._encode_present(
                self._vision, (images,), (images.dummy(),), inputs.has_image,
                None if inputs.counts is None else inputs.counts[0],
            )
        text_tokens, _, text_embeds, a_txt = self._encode_present(
            self._text, (input_ids, attention_mask), (input_ids[:1], torch.ones_like(attention_mask[:1])),
            inputs.has_text, None if inputs.counts is None else inputs.counts[1],
        )
        image_tokens = None if image_tokens is None else Tokens(image_tokens, real)
        return Encoded(image_embeds, text_embeds, image_tokens, text_tokens, a_img + a_txt)

    def text_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The text tower's tokens of (e.g. masked) captions, for MLM."""
        tokens, _ = self.text(input_ids, attention_mask)
        return tokens

    def masked_patch_tokens(self, images: Images, patch_mask: torch.Tensor) -> torch.Tensor:
        """The vision tower's patch tokens [B, patches, W] of ``images`` (one to a row) with the masked
        patches replaced by the MIM mask token (image_mim only)."""
        tokens, _ = self.vision(images, patch_mask, self.mim_head.mask_token)
        return tokens.values[:, self.vision.num_prefix:]

    def fuse(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        """Text tokens attending to the real image tokens through the fusion encoder (fusion models only)."""
        return self.fusion(text_tokens, attention_mask, image_tokens)

    # -- the passes the objectives run (vltrain.types.ModelPasses) -----------------------------------

    @property
    def spec(self) -> ModelSpec:
        """What the objectives know of this model: its heads, vocabulary and patches."""
        heads = {"itm": self.itm_head, "mlm": self.mlm_head, "text_mlm": self.text_mlm_head, "image_mim": self.mim_head,
                 "caption": self.decoder, "selfdist": self.selfdist}
        locca = isinstance(self.decoder, LocCaDecoder)
        if locca:
            heads |= {"referring": self.decoder, "grounded_caption": self.decoder}
        return ModelSpec(frozenset(k for k, head in heads.items() if head is not None), self.vocab_size, self.pad_id,
                         self.mask_id, self.vision.cfg.patch_size, self.vision.cfg.num_patches,
                         self.decoder.vocab.bins if locca else 0)

    def itm_logits(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        """[B, 2] ITM logits of fused pairs (training's positives and negatives, evaluation's re-ranking)."""
        return self.itm_head(self.fuse(text_tokens, attention_mask, image_tokens))

    def mlm_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        """[B, L, V] MLM logits: the (masked) captions re-encoded by the text tower and fused with their images."""
        tokens = self.text_tokens(input_ids, attention_mask)
        return self.mlm_head(self.fuse(tokens, attention_mask, image_tokens))

    def locca_logits(self, rows: TaskRows, image_tokens: Tokens, has_image: torch.Tensor) -> torch.Tensor:
        """[N, L, V] the LocCa decoder's logits of ``rows`` (its tasks' rows), reading ``image_tokens``
        where ``has_image``."""
        return self.decoder.rows(rows, image_tokens, has_image)

    def locca_readout(self, rows: TaskRows, image_tokens: Tokens, has_image: torch.Tensor) -> Readout:
        """What :meth:`locca_logits` makes its logits of (``model.loss.caption_chunk``)."""
        weight, bias = self.decoder.vocabulary
        return Readout(self.decoder.row_states(rows, image_tokens, has_image), weight, bias)

    def caption_logits(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
                       has_image: torch.Tensor) -> torch.Tensor:
        """[B, L, V] next-token logits of the decoder over the text tower's tokens, reading the real
        image tokens in the rows that have an image (caption)."""
        return self.decoder(text_tokens, attention_mask, image_tokens, has_image)

    def caption_readout(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
                        has_image: torch.Tensor) -> Readout:
        """What :meth:`caption_logits` makes its logits of: the decoder's states and its map to the
        vocabulary (caption, with ``model.loss.caption_chunk``)."""
        weight, bias = self.decoder.vocabulary
        return Readout(self.decoder.states(text_tokens, attention_mask, image_tokens, has_image), weight, bias)

    # -- generation (the decoder's; vltrain.model.generate drives it) ---------------------------

    def image_tokens(self, images: Images | torch.Tensor) -> Tokens:
        """The vision tower's tokens of images (an :class:`~vltrain.images.Images`; a tensor: square)."""
        tokens, _ = self.vision(images)
        return tokens

    def caption_start(self, image_tokens: Tokens, has_image: torch.Tensor, prompt_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, DecoderCache]:
        """The next-token logits [B, V] after ``prompt_ids`` [B, P] (a start token, then any
        prompt), and the cache that generation extends one position at a time."""
        cache = DecoderCache.empty(len(self.text.blocks), len(self.decoder.blocks), image_tokens, has_image)
        return self.caption_step(prompt_ids, cache), cache

    def caption_step(self, ids: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """The next-token logits [B, V] after the new positions ``ids`` [B, n]; ``cache`` grows by them."""
        tokens = self.text.step(ids, cache.text, cache.length)
        cache.length += ids.shape[1]
        return self.decoder.step(tokens, cache)[:, -1]

    def caption_next(self, ids: torch.Tensor, image_tokens: Tokens, has_image: torch.Tensor) -> torch.Tensor:
        """The next-token logits [B, V] after ``ids`` [B, n], every position recomputed (no cache)."""
        mask = torch.ones_like(ids)
        tokens, _ = self.text(ids, mask)
        return self.caption_logits(tokens, mask, image_tokens, has_image)[:, -1]

    def text_mlm_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, V] MLM logits of the text tower alone (text_mlm)."""
        return self.text_mlm_head(self.text_tokens(input_ids, attention_mask))

    def mim_prediction(self, images: Images, patch_mask: torch.Tensor) -> torch.Tensor:
        """[B, patches, 3 * p * p] SimMIM's predicted pixels of every patch (image_mim)."""
        return self.mim_head(self.masked_patch_tokens(images, patch_mask))

    def selfdist_logits(self, images: Images, patch_mask: torch.Tensor | None = None, silc: bool = True,
                        tips: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SILC's prototype logits of the pooled vector [B, K] and TIPS's of the patch tokens [B, N, K]
        of ``images`` (one to a row), the ``patch_mask`` patches entering as the heads' mask token;
        None for a head not asked for."""
        heads = self.selfdist
        tokens, pooled = self.vision(images, patch_mask, heads.mask_token if patch_mask is not None else None)
        return (heads.silc(pooled) if silc else None,
                heads.tips(tokens.values[:, self.vision.num_prefix:]) if tips else None)

    def selfdist_centres(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's running centres of SILC's and TIPS's logits ([K] each, buffers)."""
        return self.selfdist.silc.centre, self.selfdist.tips.centre

    def selfdist_anchor(self) -> torch.Tensor:
        return self.selfdist.anchor()

    # -- the model protocol (vltrain.model.weight_decay) -------------------------------------------

    def no_weight_decay(self) -> set[str]:
        """The usual exemptions, and SILC's and TIPS's heads, which wait for their stage at a zero
        gradient: decay would shrink them before it starts."""
        return default_no_weight_decay(self) | {n for n, _ in self.named_parameters() if n.startswith("selfdist.")}

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for tower in (self.vision, self.text, self.fusion, self.decoder):
            if tower is None:
                continue
            if hasattr(tower, "set_checkpointing"):
                tower.set_checkpointing(enabled)
            else:
                tower.checkpointing = enabled

    def blocks_for_sharding(self) -> list[nn.Module]:
        """Transformer blocks in forward order (FSDP2 shards each one separately)."""
        blocks = list(self.vision.blocks) + list(self.text.blocks)
        for part in (self.fusion, self.decoder):
            blocks += list(part.blocks) if part is not None else []
        return blocks

    def layer_ids(self) -> dict[str, tuple[int, int]]:
        """``name -> (layer, top)`` of every tower parameter, for layer-wise learning-rate decay.

        Two stacks, each counted from its own input: the vision tower; the text tower with the
        fusion blocks on top (ALBEF's text and fusion layers are the two halves of one BERT), or the
        decoder's (CoCa's unimodal and multimodal text layers). In a
        stack of n blocks, the embeddings (patch or token embedding, positions, class token, pre-norm)
        are layer 0, block i is layer i + 1, and top = n + 1 is the layer of every parameter the map
        leaves out: the towers' final norms and pooling heads (SigLIP's attention pool), the
        projections, the temperature, the heads.
        """
        layers: dict[int, tuple[int, int]] = {}
        for stack in ((self.vision,), (self.text, self.fusion, self.decoder)):
            towers = [t for t in stack if t is not None]
            top = sum(len(t.blocks) for t in towers) + 1
            offset = 0
            for k, tower in enumerate(towers):
                for i, block in enumerate(tower.blocks):
                    layers.update({id(p): (offset + i + 1, top) for p in block.parameters()})
                offset += len(tower.blocks)
                above = [m for m in (getattr(tower, "norm", None), getattr(tower, "head", None)) if m is not None]
                skip = {id(p) for m in above for p in m.parameters()}
                if k == 0:  # the stack's input side: what is neither a block nor the final norm
                    layers.update({id(p): (0, top) for p in tower.parameters() if id(p) not in layers and id(p) not in skip})
        return {n: layers[id(p)] for n, p in self.named_parameters() if id(p) in layers}

    def flops_per_sample(self, text_len: int | None = None, kept_patches: int | None = None) -> float:
        """Training FLOPs of one image-text sample: 3 x the forward matmul FLOPs (backward ~ 2x forward).
        ``kept_patches``: the patches the vision tower sees under patch dropout (None: all).

        The contrastive logits (2 x D per sample per global-batch column) are left out: they are
        negligible next to the towers at any batch size that fits in memory.
        """
        length = text_len or self.max_text_length
        f = self.vision.flops(kept_patches) + self.text.flops(length)
        f += 2 * (self.vision.width + self.text.width) * self.embed_dim
        if self.fusion is not None:
            n = self.vision.num_tokens if kept_patches is None else kept_patches + self.vision.num_prefix
            if self.itm_head is not None:
                f += 3 * (self.fusion.flops(length, n) + 2 * self.fusion.width * 2)
            if self.mlm_head is not None:
                w = self.text.width
                f += self.text.flops(length) + self.fusion.flops(length, n) + 2 * length * (w * w + w * self.vocab_size)
        if self.text_mlm_head is not None:
            w = self.text.width
            f += self.text.flops(length) + 2 * length * (w * w + w * self.vocab_size)
        if self.decoder is not None:
            n = self.vision.num_tokens if kept_patches is None else kept_patches + self.vision.num_prefix
            f += self.decoder.flops(length, n, self.vocab_size)
        if self.mim_head is not None:
            f += self.vision.flops() + 2 * self.vision.num_tokens * self.vision.width * self.mim_head.decoder.out_features
        return 3.0 * f
