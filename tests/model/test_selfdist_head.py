"""The prototype head of SILC and TIPS (vltrain.model.selfdist): DINO's head written plainly: its
shapes, unit prototype rows in effect, its init, and a state dict of plain tensors with the centre."""

import torch
import torch.nn.functional as F

from vltrain.model.selfdist import HeadSettings, PrototypeHead

SMALL = HeadSettings(prototypes=32, hidden=24, bottleneck=8, layers=3)


def _head(settings: HeadSettings = SMALL, width: int = 16) -> PrototypeHead:
    torch.manual_seed(0)
    return PrototypeHead(width, settings)


def test_features_of_any_leading_shape_give_logits_over_the_prototypes():
    head = _head()
    assert head(torch.randn(5, 16)).shape == (5, 32)  # pooled vectors: SILC
    assert head(torch.randn(2, 7, 16)).shape == (2, 7, 32)  # patch tokens: TIPS
    sizes = [(m.in_features, m.out_features) for m in head.mlp if isinstance(m, torch.nn.Linear)]
    assert sizes == [(16, 24), (24, 24), (24, 8)]
    assert [type(m) for m in head.mlp] == [torch.nn.Linear, torch.nn.GELU] * 2 + [torch.nn.Linear]
    one = _head(HeadSettings(prototypes=32, hidden=24, bottleneck=8, layers=1))
    assert [(m.in_features, m.out_features) for m in one.mlp] == [(16, 8)]


def test_a_logit_is_the_cosine_of_the_bottleneck_and_a_prototype():
    head = _head()
    x = torch.randn(6, 16)
    expected = F.normalize(head.mlp(x), dim=-1) @ F.normalize(head.prototypes, dim=1).T
    logits = head(x)
    torch.testing.assert_close(logits, expected)
    assert logits.abs().max() <= 1 + 1e-6


def test_scaling_the_raw_prototypes_changes_nothing():
    head = _head()
    x = torch.randn(6, 16)
    before = head(x)
    with torch.no_grad():
        head.prototypes.mul_(torch.rand(32, 1) * 10 + 0.1)  # each row by its own positive factor
    torch.testing.assert_close(head(x), before, rtol=1e-6, atol=1e-6)


def test_init_is_dinos_and_the_state_dict_is_plain_tensors_with_the_centre():
    head = _head(HeadSettings(prototypes=4096, hidden=256, bottleneck=256, layers=3), width=256)
    linears = [m for m in head.mlp if isinstance(m, torch.nn.Linear)]
    for w in [m.weight for m in linears] + [head.prototypes]:
        assert abs(w.std().item() - 0.02) < 0.002  # cut at +-2 absolute, as DINO's: a normal in effect
    assert all((m.bias == 0).all() for m in linears)
    state = head.state_dict()
    assert set(state) == {"mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "mlp.4.weight", "mlp.4.bias",
                          "prototypes", "centre"}
    assert (state["centre"] == 0).all() and state["centre"].shape == (4096,)
    assert "centre" not in dict(head.named_parameters())


def test_the_centre_is_restored_from_a_checkpoint_and_the_gradient_reaches_every_parameter():
    head = _head()
    with torch.no_grad():
        head.centre.copy_(torch.arange(32.0))
    copy = _head()
    copy.load_state_dict(head.state_dict())
    assert torch.equal(copy.centre, torch.arange(32.0))
    copy(torch.randn(3, 5, 16)).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in copy.parameters())
