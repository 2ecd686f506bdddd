"""DataConfig.resolve: the padding multiple and the budgets, decided once for sampler and collator;
the native-shape settings the data alone decides, checked once."""

from __future__ import annotations

import pytest
from kits.sampler_fixtures import TableDataset, shapes_lengths, table

from vltrain.data.config import DataConfig, ResolvedBatching, check_patch_budget
from vltrain.data.image_input import decode_for
from vltrain.data.native import native_grid
from vltrain.errors import ConfigError
from vltrain.data.loading.loader import build_train_loader


def test_zeros_resolve_per_batching():
    assert DataConfig(batch_size=8).resolve() == ResolvedBatching(8, 8 * 77 // 2, 8)
    assert DataConfig(batch_size=8, batching="budget").resolve() == ResolvedBatching(1, 8 * 77 // 2, 8)


def test_the_default_token_budget_holds_one_padded_caption_of_max_length():
    assert DataConfig(batch_size=1, max_text_length=77).resolve().token_budget == 80  # 77 rounded up to 8
    assert DataConfig(batch_size=1, max_text_length=77, batching="budget").resolve().token_budget == 77


def test_given_values_are_kept():
    cfg = DataConfig(batching="budget", pad_multiple=16, token_budget=500, image_budget=3)
    assert cfg.resolve() == ResolvedBatching(16, 500, 3)


def test_the_train_loader_plans_and_pads_with_the_resolved_values():
    t = table(shapes_lengths(40))
    for batching in ("fixed", "budget"):
        cfg = DataConfig(batching=batching, batch_size=8, num_workers=0, pin_memory=False, image_size=4)
        loader = build_train_loader(cfg, TableDataset(t, 4), rank=0, world_size=1, seed=0, run_dir=None, pad_id=0)
        resolved, s = cfg.resolve(), loader.sampler
        assert (s.pad_multiple, s.token_budget, s.image_budget) == (
            resolved.pad_multiple, resolved.token_budget, resolved.image_budget)
        assert loader._loader.collate_fn.pad_multiple == resolved.pad_multiple
        widths = {next(loader).input_ids.shape[1] for _ in range(len(loader))}
        assert all(w % resolved.pad_multiple == 0 for w in widths)


@pytest.mark.parametrize("min_patches, max_patches", [(300, 256), (0, 256), (1, 0), (2, 1)])
def test_one_rule_refuses_a_patch_budget_no_grid_meets(min_patches, max_patches):
    """The config (when read) and native_grid (called without a config) refuse the same budgets, as a
    ConfigError, which is a ValueError: not an image's fault."""
    with pytest.raises(ConfigError, match=r"data\.min_patches .* at most data\.max_patches"):
        check_patch_budget(min_patches, max_patches)
    with pytest.raises(ConfigError, match="data.min_patches"):
        DataConfig(min_patches=min_patches, max_patches=max_patches).validate()
    with pytest.raises(ValueError, match="min_patches"):
        native_grid(100, 100, 16, max_patches, min_patches)


def test_budgets_a_grid_meets_pass():
    for low, high in ((1, 1), (1, 256), (256, 256)):
        check_patch_budget(low, high)
        DataConfig(min_patches=low, max_patches=high).validate()


def test_data_code_reads_the_patch_side_only_once_it_is_decided():
    undecided = DataConfig(resize="native")
    with pytest.raises(ConfigError, match="data.patch_size is not resolved.*fit_native"):
        undecided.native_patch()
    with pytest.raises(ConfigError, match="data.patch_size is not resolved"):
        decode_for(b"any bytes: the setting is refused before the image is read", undecided)
    assert DataConfig(resize="native", patch_size=14).native_patch() == 14
