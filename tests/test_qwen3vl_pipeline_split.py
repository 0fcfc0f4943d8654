"""Where Qwen3-VL's DeepStack levels may go over pipeline stages (models/qwen3vl/model.py `check_deepstack_stage`):
every level feeds a layer of the first stage, which holds the vision tower, and that stage's layer count is
megatron's (`get_num_layers_to_build`), which the `megatron:` subtree can make uneven
(`num_layers_in_first_pipeline_stage`, `num_layers_in_last_pipeline_stage`, `pipeline_model_parallel_layout`).
The check runs in the model's constructor before any module is built, so it is tested here on CPU in this process
with megatron's parallel sizes stood in (TP 1, PP 2 or 4) and the tiny Qwen3-VL preset (4 layers, 2 levels)."""
import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_config import TransformerConfig

from rollplex_megatron.models.qwen3vl import model as M
from rollplex_megatron.recipes import load_run_config


@pytest.fixture
def tiny():
    cfg = load_run_config(["model=qwen3_vl_tiny"]).model
    assert cfg.num_layers == 4 and len(cfg.vision.deepstack_visual_indexes) == 2
    return cfg


def _build(monkeypatch, cfg, pp: int, megatron: dict) -> None:
    """The model's constructor at TP 1 and PP `pp` (megatron's parallel sizes stood in)."""
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: pp)
    M.Qwen3VLModel(cfg, torch.float32, megatron=megatron)


@pytest.mark.parametrize("setting, value", [("num_layers_in_first_pipeline_stage", 1),
                                            ("num_layers_in_last_pipeline_stage", 3)])
def test_an_uneven_split_that_leaves_deepstack_off_the_first_stage_is_refused(monkeypatch, tiny, setting, value):
    # 4 layers over 2 stages, 1 of them first: an even split's count (4 // 2 = 2) would let both levels pass. The
    # constructor refuses any uneven split first (the weight layout assumes even ones); the DeepStack check on
    # megatron's own count holds behind it
    with pytest.raises(ValueError, match=f"megatron.{setting} splits the decoder's layers unevenly"):
        _build(monkeypatch, tiny, 2, {setting: value})
    with pytest.raises(ValueError) as e:
        M.check_deepstack_stage(tiny, TransformerConfig(**M._llm_fields(tiny, torch.float32, 1, 2), **{setting: value}))
    assert str(e.value) == (f"parallel.pp=2 with megatron.{setting}={value} leaves 1 LLM layers on the first pipeline "
                            f"stage but DeepStack feeds 2 (model.vision.deepstack_visual_indexes, all on the first "
                            f"stage); give the first stage at least 2 through those settings, or drop them")


def test_an_even_split_too_short_for_deepstack_names_parallel_pp(monkeypatch, tiny):
    with pytest.raises(ValueError, match=r"^parallel.pp=4 leaves 1 LLM layers on the first pipeline stage but "
                                         r"DeepStack feeds 2 .*; lower parallel.pp$"):
        _build(monkeypatch, tiny, 4, {})


@pytest.mark.parametrize("megatron, first", [({}, 2), ({"num_layers_in_first_pipeline_stage": 3}, 3),
                                             ({"num_layers_in_last_pipeline_stage": 1}, 3),
                                             ({"pipeline_model_parallel_layout": "Et|tttL"}, 1)])
def test_the_first_stage_count_is_megatrons(tiny, megatron, first):
    tc = TransformerConfig(**M._llm_fields(tiny, torch.float32, 1, 2), **megatron)
    assert M.first_stage_layers(tc) == first
    if first >= 2:
        M.check_deepstack_stage(tiny, tc)  # both levels on the first stage: accepted
    else:
        with pytest.raises(ValueError, match="pipeline_model_parallel_layout"):
            M.check_deepstack_stage(tiny, tc)
