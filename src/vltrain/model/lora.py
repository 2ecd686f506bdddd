"""LoRA (``train.lora``): low-rank adapters on the towers' attention and MLP projections, through peft.

Our towers project q, k and v with one fused matrix, as OpenCLIP's do, while people adapt them
apart, by the names transformers gives them (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``,
``fc1``, ``fc2``). :func:`add_adapters` therefore first splits each targeted block's fused
projection into three (:class:`SplitQKV`: the same output, three matrices), then has peft put its
LoRA layers on the projections named, and freezes everything else. :func:`merge_adapters` folds the
adapters into the weights and gives the model its plain layout back (the fused projection
included), which every exporter and the evaluation read.

peft is imported here only, and only when a run asks for LoRA: a run without it builds the model it
always did.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch
from torch import nn

from vltrain.errors import ConfigError
from vltrain.types import Settings

TARGETS = {"q_proj": "attn.qkv.q_proj", "k_proj": "attn.qkv.k_proj", "v_proj": "attn.qkv.v_proj",
           "out_proj": "attn.out", "fc1": "mlp.fc", "fc2": "mlp.proj"}
"""A target's name (transformers' name of the layer) -> where it sits in one of our blocks."""
SPLIT = ("q_proj", "k_proj", "v_proj")
ADAPTER = "default"
"""peft's name of the one adapter a model carries."""


@dataclass
class LoraSettings(Settings):
    rank: int = 0
    """The adapters' rank r (0: no LoRA; the whole model trains as the rest of the config says). With
    it, only the adapters train: every other weight is frozen."""
    alpha: float = 0.0
    """peft's lora_alpha: the adapters' output is scaled by alpha / rank. 0: alpha = rank (scale 1)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout), in [0, 1)."""
    towers: list[str] = field(default_factory=lambda: ["vision", "text"])
    """The towers whose blocks get adapters (any of the model's towers with blocks)."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj"])
    """The layers of each block that get adapters, by transformers' names: q_proj, k_proj and v_proj
    (adapted apart, though our blocks fuse them), out_proj, and the MLP's fc1 and fc2."""
    last_blocks: int = 0
    """Adapt only each tower's last N blocks (0: every block)."""
    adapters: str = ""
    """Start from these adapters instead of fresh ones: a folder peft's save_pretrained wrote
    (adapter_config.json, adapter_model.safetensors; ``vltrain export --adapters`` writes one) for
    the model model.init names."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    def validate(self) -> None:
        if self.rank < 0 or self.alpha < 0:
            raise ConfigError(f"train.lora.rank and train.lora.alpha must be >= 0, got rank {self.rank}, alpha {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"train.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.last_blocks < 0:
            raise ConfigError(f"train.lora.last_blocks must be >= 0 (0: every block), got {self.last_blocks}")
        for target in self.targets:
            if target not in TARGETS:
                close = difflib.get_close_matches(target, TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"train.lora.targets: {target!r} is not a layer LoRA adapts{hint}; "
                                  f"choose from {', '.join(TARGETS)}")
        if self.enabled and not (self.targets and self.towers):
            raise ConfigError("train.lora needs at least one tower (train.lora.towers) and one layer "
                              "(train.lora.targets) to adapt")
        if self.adapters and not self.enabled:
            raise ConfigError(f"train.lora.adapters={self.adapters} needs train.lora.rank (the adapters' rank, "
                              "as their adapter_config.json says)")


class SplitQKV(nn.Module):
    """A fused q, k, v projection as three: the same output (q, k and v concatenated), three
    matrices that LoRA adapts apart."""

    def __init__(self, fused: nn.Linear):
        super().__init__()
        width = fused.out_features // 3
        for name, weight, bias in zip(SPLIT, fused.weight.detach().chunk(3),
                                      fused.bias.detach().chunk(3) if fused.bias is not None else (None,) * 3):
            part = nn.Linear(fused.in_features, width, bias=bias is not None, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                part.weight.copy_(weight)
                if bias is not None:
                    part.bias.copy_(bias)
            setattr(self, name, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def fused(self) -> nn.Linear:
        """One Linear again (the adapters merged into the parts first)."""
        parts = [_plain(getattr(self, n)) for n in SPLIT]
        weight = torch.cat([p.weight.detach() for p in parts])
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                        device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            out.weight.copy_(weight)
            if out.bias is not None:
                out.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
        return out


def _plain(module: nn.Module) -> nn.Module:
    """The layer under peft's LoRA layer (``base_layer``), or the layer itself."""
    return getattr(module, "base_layer", module)


def adapted_towers(model: nn.Module, settings: LoraSettings) -> dict[str, nn.ModuleList]:
    """The blocks of each tower ``train.lora.towers`` names; a tower the model lacks is an error
    that names the ones it has."""
    have = {name: tower.blocks for name, tower in model.named_children()
            if isinstance(getattr(tower, "blocks", None), nn.ModuleList)}
    for name in settings.towers:
        if name not in have:
            raise ConfigError(f"train.lora.towers names {name!r}, which this model has no blocks in; "
                              f"its towers with blocks: {', '.join(have) or 'none'}")
    return {name: have[name] for name in settings.towers}


def target_names(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The full names of the layers to adapt (in the split layout); a target that is no layer of a
    tower's blocks is an error naming the linear layers they have."""
    names = []
    for tower, blocks in adapted_towers(model, settings).items():
        n = settings.last_blocks or len(blocks)
        if n > len(blocks):
            raise ConfigError(f"train.lora.last_blocks={n}, but {tower} has {len(blocks)} blocks; give at most {len(blocks)}")
        for i in range(len(blocks) - n, len(blocks)):
            block = blocks[i]
            for target in settings.targets:
                where = TARGETS[target]
                if _find(block, where) is None:
                    linear = [k for k, m in block.named_modules() if isinstance(m, nn.Linear)]
                    raise ConfigError(f"train.lora.targets: {target!r} ({where}) matches no layer of {tower}'s "
                                      f"block {i}; its linear layers: {', '.join(linear)}")
                names.append(f"{tower}.blocks.{i}.{where}")
    return names


def _find(block: nn.Module, where: str) -> nn.Module | None:
    """The layer at ``where`` in ``block``, a fused q, k, v projection counting as its parts."""
    parent, _, leaf = where.rpartition(".")
    if leaf in SPLIT:
        qkv = _get(block, parent)
        return qkv if isinstance(qkv, (nn.Linear, SplitQKV)) else None
    found = _get(block, where)
    return found if isinstance(found, nn.Linear) else None


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def add_adapters(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Split the targeted fused projections, put peft's LoRA layers on the targets, and freeze
    everything but them. Returns the adapted layers' names. The adapters' A matrices are drawn from
    torch's generator (B starts at zero: the model's output is unchanged)."""
    from peft import LoraConfig, inject_adapter_in_model

    names = target_names(model, settings)
    for qkv in sorted({n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in SPLIT}):
        parent, _, leaf = qkv.rpartition(".")
        owner = model.get_submodule(parent)
        if isinstance(getattr(owner, leaf), nn.Linear):
            setattr(owner, leaf, SplitQKV(getattr(owner, leaf)))
    model.requires_grad_(False)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha or settings.rank, lora_dropout=settings.dropout,
                        target_modules=names, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return names


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight (W + scale * B A) and give the model its plain
    layout: peft's layers replaced by the layers under them, split projections fused again. The
    model's trainable flags are left as they were before the adapters: all true."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[ADAPTER])
            _replace(model, name, module.get_base_layer())
    for name, module in list(model.named_modules()):
        if isinstance(module, SplitQKV):
            _replace(model, name, module.fused())
    model.requires_grad_(True)
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
