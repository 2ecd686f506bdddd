"""model.init from an OpenCLIP checkpoint: a state dict with open_clip's names and shapes, written here
from a Hugging Face CLIPModel (OpenAI-layout CLIP and HF CLIP are the same math), gives that model's
embeddings."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kits.pretrainedkit import TEXTS, clip_tokenizer, make_clip, normalized  # noqa: E402

from vltrain.errors import UserError  # noqa: E402
from vltrain.export.native import embed  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402


def _block(sd: dict, ours: str, hf: str) -> dict:
    """open_clip's ResidualAttentionBlock: ln_1, nn.MultiheadAttention (q, k, v in one in_proj), ln_2, mlp."""
    out = {}
    for p in ("weight", "bias"):
        out[f"{ours}.ln_1.{p}"] = sd[f"{hf}.layer_norm1.{p}"]
        out[f"{ours}.attn.in_proj_{p}"] = torch.cat([sd[f"{hf}.self_attn.{x}_proj.{p}"] for x in "qkv"])
        out[f"{ours}.attn.out_proj.{p}"] = sd[f"{hf}.self_attn.out_proj.{p}"]
        out[f"{ours}.ln_2.{p}"] = sd[f"{hf}.layer_norm2.{p}"]
        out[f"{ours}.mlp.c_fc.{p}"] = sd[f"{hf}.mlp.fc1.{p}"]
        out[f"{ours}.mlp.c_proj.{p}"] = sd[f"{hf}.mlp.fc2.{p}"]
    return out


def openclip_state_dict(hf, text_prefix: str = "") -> dict:
    """open_clip's CLIP (``text_prefix`` "text.": CustomTextCLIP) state dict of ``hf``'s weights."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    v, t, tp = "vision_model", "text_model", text_prefix
    out = {"visual.conv1.weight": sd[f"{v}.embeddings.patch_embedding.weight"],
           "visual.class_embedding": sd[f"{v}.embeddings.class_embedding"],
           "visual.positional_embedding": sd[f"{v}.embeddings.position_embedding.weight"],
           "visual.proj": sd["visual_projection.weight"].T.contiguous(),
           f"{tp}token_embedding.weight": sd[f"{t}.embeddings.token_embedding.weight"],
           f"{tp}positional_embedding": sd[f"{t}.embeddings.position_embedding.weight"],
           f"{tp}text_projection": sd["text_projection.weight"].T.contiguous(),
           "logit_scale": sd["logit_scale"]}
    for p in ("weight", "bias"):
        out[f"visual.ln_pre.{p}"] = sd[f"{v}.pre_layrnorm.{p}"]
        out[f"visual.ln_post.{p}"] = sd[f"{v}.post_layernorm.{p}"]
        out[f"{tp}ln_final.{p}"] = sd[f"{t}.final_layer_norm.{p}"]
    for i in range(hf.config.vision_config.num_hidden_layers):
        out.update(_block(sd, f"visual.transformer.resblocks.{i}", f"{v}.encoder.layers.{i}"))
    for i in range(hf.config.text_config.num_hidden_layers):
        out.update(_block(sd, f"{tp}transformer.resblocks.{i}", f"{t}.encoder.layers.{i}"))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A CLIPModel with OpenCLIP's 64-wide heads and GELU, and one with QuickGELU (OpenAI's weights)."""
    root = tmp_path_factory.mktemp("openclip")
    return {act: make_clip(root / act, width=128, hidden_act=act, seed=4) for act in ("gelu", "quick_gelu")}


def _write(path, state, fmt: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    clip_tokenizer(path.parent)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    elif fmt == "training":  # open_clip's own training checkpoint: DDP's "module." names under state_dict
        torch.save({"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    else:
        torch.save(state, path)
    return path


def _embeddings(init, *overrides):
    opened = open_model(init, list(overrides))
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        images = model._vision(pixels)[-1].numpy()
    return embed(model, tokenizer, cfg, [], TEXTS), images, pixels, tokenizer, cfg


@pytest.mark.parametrize("fmt, prefix, act", [("pt", "", "gelu"), ("safetensors", "text.", "gelu"),
                                              ("training", "", "quick_gelu")])
def test_openclip_checkpoint_gives_the_equivalent_models_embeddings(reference, tmp_path, fmt, prefix, act):
    hf = reference[act]
    init = _write(tmp_path / "ckpt" / f"model.{'safetensors' if fmt == 'safetensors' else 'pt'}",
                  openclip_state_dict(hf, prefix), fmt)
    texts, images, pixels, tokenizer, cfg = _embeddings(init, *(["model.quick_gelu=true"] if act == "quick_gelu" else []))
    assert cfg.data.tokenizer == str(init.parent / "tokenizer.json") and cfg.data.max_text_length == 16
    assert cfg.model.arch["vision"]["heads"] == 2 and cfg.model.arch["text"]["depth"] == 2
    rows = [tokenizer.encode(t, 16)[0] for t in TEXTS]
    ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        want_texts = normalized(hf.get_text_features(input_ids=ids, attention_mask=mask))
        want_images = normalized(hf.get_image_features(pixel_values=pixels))
    torch.testing.assert_close(torch.from_numpy(texts), torch.from_numpy(want_texts), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.from_numpy(images), torch.from_numpy(want_images), atol=1e-5, rtol=0)


def test_openclip_without_quick_gelu_differs(reference, tmp_path):
    """QuickGELU cannot be read from shapes: leaving model.quick_gelu off gives other embeddings."""
    hf = reference["quick_gelu"]
    init = _write(tmp_path / "c" / "m.pt", openclip_state_dict(hf), "pt")
    _, images, pixels, _, _ = _embeddings(init)
    with torch.no_grad():
        want = normalized(hf.get_image_features(pixel_values=pixels))
    assert abs(images - want).max() > 1e-3


def test_openclip_errors_name_the_tensor(reference, tmp_path):
    state = openclip_state_dict(reference["gelu"])
    missing = dict(state)
    missing.pop("transformer.resblocks.1.attn.in_proj_bias")
    with pytest.raises(UserError, match=r"'transformer\.resblocks\.1\.attn\.in_proj_bias'"):
        _embeddings(_write(tmp_path / "a" / "m.pt", missing, "pt"))
    bent = dict(state)
    bent["visual.transformer.resblocks.0.mlp.c_proj.weight"] = bent["visual.transformer.resblocks.0.mlp.c_proj.weight"][:, :-1]
    with pytest.raises(UserError, match=r"'visual\.transformer\.resblocks\.0\.mlp\.c_proj\.weight' has shape \[128, 511\]"):
        _embeddings(_write(tmp_path / "b" / "m.pt", bent, "pt"))
    with pytest.raises(UserError, match="is not a clip-vit-b32: its vision width is 128"):
        _embeddings(_write(tmp_path / "c" / "m.pt", state, "pt"), "model.preset=clip-vit-b32")
    with pytest.raises(UserError, match="no tensor .visual.positional_embedding.: it is not an OpenCLIP"):
        _embeddings(_write(tmp_path / "d" / "m.pt", {"visual.conv1.weight": state["visual.conv1.weight"]}, "pt"))


def test_openclip_without_a_tokenizer_says_what_to_set(reference, tmp_path):
    init = _write(tmp_path / "e" / "m.pt", openclip_state_dict(reference["gelu"]), "pt")
    (init.parent / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="data.tokenizer.*vltrain tokenizer from-openclip --out"):
        _embeddings(init)
    (tmp_path / "tok").mkdir()
    clip_tokenizer(tmp_path / "tok")
    texts, _, _, tokenizer, cfg = _embeddings(init, f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}")
    assert texts.shape == (len(TEXTS), 32)
    # captions are cleaned as OpenCLIP cleaned them, unless the config says otherwise
    assert cfg.data.text_clean == "clip" and tokenizer.clean == "clip"
    assert tokenizer.encode("Tom &amp; Jerry", 16) == tokenizer.encode("Tom & Jerry", 16)
    *_, cfg = _embeddings(init, f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "data.text_clean=''")
    assert cfg.data.text_clean == ""


def test_an_openclip_checkpoint_read_with_more_text_positions_is_stretched(reference, tmp_path):
    """data.max_text_length above its context: the table stretched as it is read (Long-CLIP), short
    captions embedded as the checkpoint embeds them."""
    from vltrain.model.interop.stretch import stretch_positions

    hf = reference["gelu"]
    init = _write(tmp_path / "ckpt" / "model.safetensors", openclip_state_dict(hf, "text."), "safetensors")
    opened = open_model(init, ["data.max_text_length=30", "model.text.stretch_keep=8"])
    table = hf.text_model.embeddings.position_embedding.weight.detach()
    assert opened.cfg.model.arch["text"]["max_length"] == 30
    assert torch.equal(opened.model.text.pos_embed.detach(), stretch_positions(table, 30, 8))
    short = [t for t in TEXTS if len(opened.tokenizer.encode(t, 30)[0]) <= 8]
    assert short
    plain = open_model(init)
    torch.testing.assert_close(torch.from_numpy(embed(opened.model, opened.tokenizer, opened.cfg, [], short)),
                               torch.from_numpy(embed(plain.model, plain.tokenizer, plain.cfg, [], short)),
                               atol=1e-6, rtol=0)
