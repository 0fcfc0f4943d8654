"""export(import(checkpoint)) equals the checkpoint tensor for tensor; conversion is atomic."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollplex_megatron.checkpoint import convert
from rollplex_megatron.models.qwen25vl import hf_layout as layout
from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, shard_checkpoint


def _load_all(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_round_trip_is_exact(tiny_hf, tmp_path, tp, pp):
    mc = convert.hf_to_mcore(tiny_hf, tmp_path / "mc", tp, pp)
    out = convert.mcore_to_hf(mc, tmp_path / "hf", max_shard_bytes=300_000)
    src, back = _load_all(tiny_hf), _load_all(out)
    assert set(src) == set(back)
    for k in src:
        assert torch.equal(src[k], back[k]), k
    assert len(list(Path(out).glob("*.safetensors"))) > 1  # size cap exercised, index written
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(src)
    config = json.loads((Path(tiny_hf) / "config.json").read_text())
    assert json.loads((Path(out) / "config.json").read_text()) == config


def test_round_trip_tied_pipeline(tiny_hf_tied, tmp_path):
    mc = convert.hf_to_mcore(tiny_hf_tied, tmp_path / "mc", 2, 2)
    # the last stage carries megatron's copy of the tied output layer: vocab 320 padded to 512, 256 a rank
    last = torch.load(Path(mc) / convert.rank_file(1, 1))
    assert last["language_model.output_layer.weight"].shape == (256, 64)
    back = _load_all(convert.mcore_to_hf(mc, tmp_path / "hf"))
    src = _load_all(tiny_hf_tied)
    assert set(src) == set(back) and all(torch.equal(src[k], back[k]) for k in src)


def test_shards_have_megatron_layouts(tiny_hf):
    """Group-major fused QKV, [gate_r; up_r] fc1, vocab padded to 128*TP, row-parallel dim 1."""
    ck = HFCheckpoint(tiny_hf)
    cfg = ck.model_config()
    s0, s1 = (shard_checkpoint(ck, cfg, r, 2, 0, 1) for r in range(2))
    q, k, v = (ck.get(f"model.layers.0.self_attn.{n}_proj.weight") for n in "qkv")
    # tp=2 with 2 KV groups: rank r holds group r = [its 2 query heads; its k head; its v head]
    hd = 16
    want1 = torch.cat([q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    assert torch.equal(s1["language_model.decoder.layers.0.self_attention.linear_qkv.weight"], want1)
    gate, up = ck.get("model.layers.0.mlp.gate_proj.weight"), ck.get("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(s0["language_model.decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[:64], up[:64]]))
    emb = s1["language_model.embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and torch.equal(emb[:64], ck.get("model.embed_tokens.weight")[256:])
    assert torch.count_nonzero(emb[64:]) == 0
    o = ck.get("model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(s1["language_model.decoder.layers.0.self_attention.linear_proj.weight"], o[:, 32:])


def test_vision_ffn_padding_is_exact(tmp_path):
    """A vision width that TP does not divide is zero-padded and comes back unchanged."""
    from tests.hf_models import make_tiny_hf

    d = make_tiny_hf(tmp_path / "odd", seed=2, vision={"intermediate_size": 47})
    mc = convert.hf_to_mcore(d, tmp_path / "mc", 2, 1)
    shard = torch.load(Path(mc) / convert.rank_file(1, 0))["vision.blocks.layers.0.mlp.linear_fc2.weight"]
    assert shard.shape == (32, 24) and torch.count_nonzero(shard[:, -1]) == 0
    back = _load_all(convert.mcore_to_hf(mc, tmp_path / "hf"))
    src = _load_all(d)
    assert all(torch.equal(src[k], back[k]) for k in src)


def test_round_trip_check_detects_a_wrong_layout(tiny_hf):
    """Mutation: merging a fused QKV as plain rows does not give the checkpoint back."""
    ck = HFCheckpoint(tiny_hf)
    cfg = ck.model_config()
    rule = next(r for r in layout.model_rules(cfg, 2, 1) if r.kind == "qkv")
    shards = [layout.to_shard(rule, [ck.get(n) for n in rule.hf], t, 2) for t in range(2)]
    right = layout.from_shards(rule, shards, [ck.shape(n) for n in rule.hf])
    assert all(torch.equal(a, ck.get(n)) for a, n in zip(right, rule.hf))
    wrong = torch.cat(shards)[: ck.shape(rule.hf[0])[0]]
    assert not torch.equal(wrong, ck.get(rule.hf[0]))


def test_hf_to_mcore_layout_errors_name_the_flags(tiny_hf, tmp_path):
    """convert hf-to-mcore's layout comes from --tp/--pp, so its errors name those, before anything is written."""
    with pytest.raises(ValueError, match=r"^model.num_attention_heads \(4\) is not divisible by --tp \(3\)"):
        convert.hf_to_mcore(tiny_hf, tmp_path / "mc", 3, 1)
    with pytest.raises(ValueError, match=r"^model.num_layers \(4\) is not divisible by --pp \(3\)"):
        convert.hf_to_mcore(tiny_hf, tmp_path / "mc", 1, 3)
    with pytest.raises(ValueError, match=r"^convert hf-to-mcore --pp must be >= 1, got 0$"):
        convert.hf_to_mcore(tiny_hf, tmp_path / "mc", 1, 0)
    assert os.listdir(tmp_path) == []


def test_mcore_to_hf_names_a_missing_or_foreign_folder(tmp_path):
    with pytest.raises(convert.H.CheckpointError, match=r"nope: no such folder \(a megatron checkpoint is the"):
        convert.mcore_to_hf(tmp_path / "nope", tmp_path / "hf")
    (tmp_path / "other").mkdir()
    with pytest.raises(convert.H.CheckpointError, match=r"other: no rollplex_mcore.json; not a rollplex megatron"):
        convert.mcore_to_hf(tmp_path / "other", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["other"]


def test_conversion_leaves_nothing_on_failure(tiny_hf, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")

    spec = convert.model_spec(HFCheckpoint(tiny_hf).model_config())
    failing = dataclasses.replace(spec, hf=dataclasses.replace(spec.hf, shard=boom))
    monkeypatch.setattr(convert, "model_spec", lambda cfg: failing)
    with pytest.raises(RuntimeError, match="disk full"):
        convert.hf_to_mcore(tiny_hf, tmp_path / "mc", 2, 1)
    assert os.listdir(tmp_path) == []


def test_convert_cli_round_trip(tiny_hf, tmp_path):
    start = lambda *a: subprocess.Popen([sys.executable, "-m", "rollplex_megatron", "convert", *a],  # noqa: E731
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = start("hf-to-mcore", "--hf-dir", tiny_hf, "--out", str(tmp_path / "mc"), "--tp", "2", "--pp", "2")
    err = r.communicate(timeout=300)[1]
    assert r.returncode == 0, err
    mc = {p.relative_to(tmp_path / "mc"): p.read_bytes() for p in sorted((tmp_path / "mc").rglob("*")) if p.is_file()}
    # the conversion back and the refused second conversion into the same directory start together (the
    # refusal writes nothing: the directory's files are checked after both)
    back_p = start("mcore-to-hf", "--mcore-dir", str(tmp_path / "mc"), "--out", str(tmp_path / "hf"))
    again = start("hf-to-mcore", "--hf-dir", tiny_hf, "--out", str(tmp_path / "mc"))
    (out, err), (_, again_err) = back_p.communicate(timeout=300), again.communicate(timeout=300)
    assert back_p.returncode == 0, err
    assert out.strip().splitlines()[-1] == str(tmp_path / "hf")
    src, back = _load_all(tiny_hf), _load_all(tmp_path / "hf")
    assert set(src) == set(back) and all(torch.equal(src[k], back[k]) for k in src)
    assert again.returncode != 0 and "already exists" in again_err
    assert {p.relative_to(tmp_path / "mc"): p.read_bytes() for p in sorted((tmp_path / "mc").rglob("*"))
            if p.is_file()} == mc


def test_module_tree_naming_round_trip(tiny_hf, tmp_path):
    """Checkpoints saved with transformers' module names (model.language_model.*, model.visual.*)."""
    from safetensors.torch import save_file

    src = _load_all(tiny_hf)
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else
               k.replace("visual.", "model.visual.", 1) if k.startswith("visual.") else k: v
               for k, v in src.items()}
    d = tmp_path / "tree"
    d.mkdir()
    (d / "config.json").write_text((Path(tiny_hf) / "config.json").read_text())
    save_file(renamed, d / "model.safetensors")
    assert HFCheckpoint(d).naming == layout.HFNaming("model.language_model.", "model.visual.")
    back = _load_all(convert.mcore_to_hf(convert.hf_to_mcore(d, tmp_path / "mc", 2, 2), tmp_path / "hf"))
    assert set(back) == set(renamed) and all(torch.equal(back[k], renamed[k]) for k in renamed)
