"""Each method's update against peft's own code, one module at a time: deltas against
`get_delta_weight`, merged weights against `merge_and_unload()` (to float64 rounding), and
the pieces peft only runs on a GPU (BOFT's butterfly levels) against its own functions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from esd_worker.analysis.adapters import (
    BoftModule,
    Ia3Module,
    LohaModule,
    LokrModule,
    LoraModule,
    OftModule,
    PeftAdapter,
    VeraModule,
    WeightUpdate,
    lora_delta,
)
from esd_worker.analysis.layers import CONV1D, CONV2D, EMBEDDING, LINEAR
from esd_worker.core.errors import PermanentModelError
from tests.esd_worker.test_adapters import CASES, make_method_adapter
from tests.support.builders import _load_base, _quiet_warnings, peft_merged_weights

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _layer_type(module: torch.nn.Module) -> str:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return CONV1D
    if isinstance(module, torch.nn.Conv2d):
        return CONV2D
    if isinstance(module, torch.nn.Embedding):
        return EMBEDDING
    return LINEAR


def _targeted(adapter: PeftAdapter, base: torch.nn.Module) -> dict[str, WeightUpdate]:
    modules = dict(base.named_modules())
    return {name: update.targeted(_layer_type(modules[name]))
            for name, update in adapter.modules.items()}


@pytest.fixture(scope="module")
def made(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Path]:
    """Every test_adapters case's adapter, made once for this module."""
    root = tmp_path_factory.mktemp("adapters")
    return {case_id: make_method_adapter(request.getfixturevalue(case.base), root / case_id,
                                         case.config(), seed=len(case_id), edit=case.edit)
            for case_id, case in CASES.items()}


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")
@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].base != "llama_tied_dir"])
def test_merged_weight_equals_peft(case_id: str, made: dict[str, Path],
                                   request: pytest.FixtureRequest) -> None:
    """Each update applied to its float64 base weight gives peft's merged weight: the check
    that also covers rotations, which leave the spectrum as it was."""
    base_dir: Path = request.getfixturevalue(CASES[case_id].base)
    adapter = PeftAdapter(made[case_id])
    base = _load_base(base_dir, torch.float64)
    weights = {n: m.weight.detach() for n, m in base.named_modules() if hasattr(m, "weight")
               and isinstance(getattr(m, "weight", None), torch.Tensor)}
    merged = peft_merged_weights(base_dir, made[case_id])
    for name, update in _targeted(adapter, base).items():
        w = weights[name].clone()
        update.apply_(w, fan_in_fan_out=adapter.fan_in_fan_out)
        torch.testing.assert_close(w, merged[name], **TIGHT, msg=name)
        assert not torch.equal(w, weights[name]), name


def _peft_model(base_dir: Path, adapter: Path) -> Any:
    from peft import PeftModel

    with _quiet_warnings():
        return PeftModel.from_pretrained(_load_base(base_dir, torch.float64), str(adapter))


def _peft_layers(model: Any) -> dict[str, Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules()
            if isinstance(m, BaseTunerLayer)}


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")
@pytest.mark.parametrize("case_id", [c for c in CASES if not c.startswith(("ia3", "dora"))])
def test_delta_equals_get_delta_weight(case_id: str, made: dict[str, Path],
                                       request: pytest.FixtureRequest) -> None:
    """Additive methods: ΔW equals peft's get_delta_weight; OFT: the block-diagonal rotation
    equals it; BOFT: the rotation and scale it returns, applied to the identity."""
    base_dir: Path = request.getfixturevalue(CASES[case_id].base)
    adapter = PeftAdapter(made[case_id])
    layers = _peft_layers(_peft_model(base_dir, made[case_id]))
    base = _load_base(base_dir, torch.float64)
    for name, update in _targeted(adapter, base).items():
        layer = layers[name]
        shape = tuple(layer.get_base_layer().weight.shape)
        expected = layer.get_delta_weight("default")
        if isinstance(update, LoraModule):
            got = lora_delta(update, shape, fan_in_fan_out=adapter.fan_in_fan_out,
                             dtype=torch.float64)
        elif isinstance(update, (LohaModule, LokrModule)):
            got = update.delta(shape, dtype=torch.float64)
        elif isinstance(update, VeraModule):
            got = torch.zeros(shape, dtype=torch.float64)
            update.apply_(got, fan_in_fan_out=adapter.fan_in_fan_out)
        elif isinstance(update, OftModule):
            features = math.prod(shape[1:])  # in, in·kh·kw, or an embedding's dim
            got = torch.block_diag(*update.blocks(features, dtype=torch.float64))
        else:
            assert isinstance(update, BoftModule)
            rotation, _ = expected
            got, expected = _boft_rotation(update, rotation.shape[0]), rotation.t()
        torch.testing.assert_close(got, expected.to(torch.float64), **TIGHT, msg=name)


def _boft_rotation(update: BoftModule, n: int) -> torch.Tensor:
    """Mᵀ: the update, its scale set to 1, applied to an (n x n) identity."""
    w = torch.eye(n, dtype=torch.float64)
    BoftModule(update.name, update.R, torch.ones(n), LINEAR).apply_(w, fan_in_fan_out=False)
    return w


# --- the pieces peft only runs elsewhere ---------------------------------------------------


@pytest.mark.parametrize(("n", "blocks", "r", "factor"),
                         [(32, 8, 2, 1), (32, 4, 2, 1), (64, 8, 4, 2), (48, 6, 2, 1),
                          (16, 4, 2, 0)])
def test_butterfly_permutation_equals_peft(n: int, blocks: int, r: int, factor: int) -> None:
    from peft.tuners.boft.layer import BOFTLayer

    from esd_worker.analysis.adapters.orthogonal import butterfly_perm

    expected = BOFTLayer.block_butterfly_perm(None, n, blocks, r, factor)  # type: ignore[arg-type]
    assert torch.equal(butterfly_perm(n, blocks, r, factor), expected)


class _FakeFbd:
    """peft's CUDA block-diagonal kernel, in torch: without it peft forces one butterfly
    level, so an adapter with boft_n_butterfly_factor > 1 is only merged on a GPU."""

    @staticmethod
    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.stack([torch.block_diag(*level) for level in x])]


@pytest.mark.parametrize("factor", [2, 3])
def test_boft_butterfly_levels_equal_peft(factor: int, llama_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Several butterfly levels (boft_n_butterfly_factor > 1), merged as peft merges them
    where its CUDA kernel loads."""
    import peft
    from peft.tuners.boft import layer as boft_layer

    monkeypatch.setattr(boft_layer, "_FBD_CUDA", _FakeFbd())
    config = peft.BOFTConfig(boft_block_size=4, boft_n_butterfly_factor=factor,
                             target_modules=["q_proj", "down_proj"])
    adapter_dir = make_method_adapter(llama_dir, tmp_path / "boft", config)
    adapter = PeftAdapter(adapter_dir)
    merged = peft_merged_weights(llama_dir, adapter_dir)
    base = _load_base(llama_dir, torch.float64)
    weights = dict(base.named_modules())
    for name, update in _targeted(adapter, base).items():
        assert isinstance(update, BoftModule) and update.R.shape[0] == factor
        w = weights[name].weight.detach().clone()
        update.apply_(w, fan_in_fan_out=False)
        torch.testing.assert_close(w, merged[name], **TIGHT, msg=name)


@pytest.mark.parametrize("feedforward", [True, False])
def test_ia3_on_grouped_conv_equals_peft(feedforward: bool) -> None:
    """IA3 on a grouped Conv2d: a feedforward vector scales each group's input channels."""
    import peft
    from peft.tuners.ia3.layer import Conv2d

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 12, 3, groups=4).double()
    layer = Conv2d(conv, "default", config=peft.IA3Config(target_modules=["c"]),
                   is_feedforward=feedforward)
    with torch.no_grad():
        layer.ia3_l["default"].normal_()
    before = conv.weight.detach().clone()
    update = Ia3Module("c", layer.ia3_l["default"].detach().clone(), feedforward, CONV2D)
    layer.merge()
    update.apply_(before, fan_in_fan_out=False)
    torch.testing.assert_close(before, conv.weight.detach(), **TIGHT)


def test_dora_norms_follow_the_layout() -> None:
    """DoRA's norm is per output feature: rows of (out x in), columns of Conv1D's (in x out)
    and of an embedding's (num x dim); a magnitude of another length is a wrong base."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, generator=gen), torch.randn(4, 2, generator=gen)
    mag = torch.rand(4, generator=gen) + 0.5
    w = torch.randn(4, 6, dtype=torch.float64, generator=gen)
    linear = w.clone()
    LoraModule("m", a, b, 0.5, False, LINEAR, mag).apply_(linear, fan_in_fan_out=False)
    conv1d = w.t().clone()
    LoraModule("m", a, b, 0.5, False, CONV1D, mag).apply_(conv1d, fan_in_fan_out=True)
    torch.testing.assert_close(conv1d, linear.t(), **TIGHT)
    torch.testing.assert_close(torch.linalg.vector_norm(linear, dim=1), mag.double(), **TIGHT)
    with pytest.raises(PermanentModelError, match=r"DoRA magnitude.*wrong base model"):
        LoraModule("m", a, b, 0.5, False, LINEAR, mag[:3]).apply_(w.clone(),
                                                                  fan_in_fan_out=False)


@pytest.mark.parametrize(
    ("update", "target"),
    [
        pytest.param(LohaModule("m", {}, 1.0), "Conv1D", id="loha-conv1d"),
        pytest.param(OftModule("m", torch.zeros(4, 6)), "Conv1D", id="oft-conv1d"),
        pytest.param(BoftModule("m", torch.zeros(1, 2, 2, 2), torch.ones(4, 1)), "Embedding",
                     id="boft-embedding"),
        pytest.param(VeraModule("m", *[torch.zeros(1)] * 4), "Conv2d", id="vera-conv2d"),
        pytest.param(Ia3Module("m", torch.zeros(1), True), "Embedding", id="ia3-embedding"),
    ],
)
def test_layer_types_peft_never_adapts_mean_a_wrong_base(update: WeightUpdate,
                                                         target: str) -> None:
    with pytest.raises(PermanentModelError, match=f"{target} layer, which peft's .* never "
                                                  "adapts .*wrong base model"):
        update.targeted(target).check_target()
