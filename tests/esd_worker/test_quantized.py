"""Quantized checkpoints read as float weights (esd_worker.analysis.quantized): for every
scheme, a float matrix quantized by the scheme's layout into a tiny safetensors checkpoint
reads back as the scheme's own dequantization (tests/esd_worker/quantizing.py says which
reference each uses); refused layouts keep their key with one line; a dense checkpoint is
handed back as it is."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from esd_worker.analysis.quantized import dequantized
from esd_worker.analysis.weights import Checkpoint, Tensors
from tests.esd_worker import quantizing as q
from tests.support.builders import make_llama


def needs(name: str) -> None:
    """Skip a case whose reference is a library not installed (bitsandbytes and
    compressed-tensors are test dependencies only; the worker needs neither)."""
    for prefix, module in (("ct-", "compressed_tensors"), ("compressed-", "compressed_tensors"),
                           ("bnb", "bitsandbytes")):
        if name.startswith(prefix):
            pytest.importorskip(module)


def _ct(fmt: str, shape: tuple[int, int] = (48, 96), **weights: Any) -> Callable[[], q.Quantized]:
    return lambda: q.compressed(fmt, weights, shape)


# name -> (builder, the scheme the layer row names)
CASES: dict[str, tuple[Callable[[], q.Quantized], str]] = {
    "gptq-int4-sym": (lambda: q.gptq(), "gptq-int4-g32"),
    "gptq-int4-asym-act-order": (lambda: q.gptq(sym=False, act_order=True), "gptq-int4-g32"),
    "gptq-int4-v2": (lambda: q.gptq(sym=False, v2=True), "gptq-int4-g32"),
    "gptq-int8": (lambda: q.gptq(bits=8, group=48), "gptq-int8-g48"),
    "gptq-int2": (lambda: q.gptq(bits=2, sym=False), "gptq-int2-g32"),
    "gptq-int4-partial-group": (lambda: q.gptq(inputs=80, group=32), "gptq-int4-g32"),
    "awq-int4": (lambda: q.awq(), "awq-int4-g32"),
    "fp8-block-deepseek": (lambda: q.fp8_blocks(), "fp8-e4m3-block128x128"),
    "fp8-block-no-config": (lambda: q.fp8_blocks(config=False), "fp8-e4m3-block128x128"),
    "fp8-e5m2-block": (lambda: q.fp8_blocks(dtype=torch.float8_e5m2), "fp8-e5m2-block128x128"),
    "fp8-small-blocks": (lambda: q.fp8_blocks((70, 90), block=(32, 16)), "fp8-e4m3-block32x16"),
    "ct-fp8-tensor": (_ct("float-quantized", num_bits=8, type="float", strategy="tensor"),
                      "fp8-e4m3-tensor"),
    "ct-fp8-channel": (_ct("float-quantized", num_bits=8, type="float", strategy="channel"),
                       "fp8-e4m3-channel"),
    "ct-fp8-group": (_ct("float-quantized", num_bits=8, type="float", strategy="group",
                         group_size=32), "fp8-e4m3-g32"),
    "ct-fp8-block": (_ct("float-quantized", (80, 100), num_bits=8, type="float",
                         strategy="block", block_structure=[32, 64]), "fp8-e4m3-block32x64"),
    "ct-int8-channel": (_ct("int-quantized", num_bits=8, type="int", strategy="channel"),
                        "compressed-int8-channel"),
    "ct-int4-group": (_ct("pack-quantized", num_bits=4, type="int", strategy="group",
                          group_size=32), "compressed-int4-g32"),
    "ct-int4-group-asym": (_ct("pack-quantized", num_bits=4, type="int", symmetric=False,
                               strategy="group", group_size=32), "compressed-int4-g32"),
    "ct-int4-channel-odd-width": (_ct("pack-quantized", (48, 100), num_bits=4, type="int",
                                      strategy="channel"), "compressed-int4-channel"),
    "ct-int4-act-order": (lambda: q.compressed_act_order(), "compressed-int4-g32"),
    "ct-int8-packed-asym": (_ct("pack-quantized", num_bits=8, type="int", symmetric=False,
                                strategy="channel"), "compressed-int8-channel"),
    "ct-nvfp4": (_ct("nvfp4-pack-quantized", num_bits=4, type="float",
                     strategy="tensor_group", group_size=16), "nvfp4"),
    "ct-mxfp4": (_ct("mxfp4-pack-quantized", num_bits=4, type="float", strategy="group",
                     group_size=32, scale_dtype=torch.uint8), "mxfp4"),
    "bnb-nf4": (lambda: q.bnb4(), "bnb-nf4"),
    "bnb-fp4": (lambda: q.bnb4(quant_type="fp4"), "bnb-fp4"),
    "bnb-nf4-double-quant-partial-block": (lambda: q.bnb4((33, 70), nested=True), "bnb-nf4"),
    "bnb-int8": (lambda: q.bnb8(), "bnb-int8"),
    "gpt-oss-mxfp4": (lambda: q.gpt_oss(), "mxfp4"),
}


def view_of(directory: Path, tensors: dict[str, torch.Tensor],
            config: dict[str, Any] | None) -> tuple[Checkpoint, Tensors]:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    checkpoint = Checkpoint(directory)
    config_json = None if config is None else {"quantization_config": config}
    return checkpoint, dequantized(checkpoint, config_json, directory)


def assert_covers(view: Tensors, stored: set[str]) -> None:
    """Every stored tensor is a key of the view or folded into one, never both."""
    folded = view.folded()
    keys = set(view.keys())
    assert not keys & set(folded), keys & set(folded)
    assert set(folded.values()) <= keys
    assert stored - keys == set(folded)


@pytest.mark.parametrize("name", CASES)
def test_read_is_the_schemes_own_dequantization(name: str, tmp_path: Path) -> None:
    needs(name)
    build, scheme = CASES[name]
    case = build()
    checkpoint, view = view_of(tmp_path, case.tensors, case.config)
    key = case.key
    assert view is not checkpoint
    assert key in view.keys() and key in view  # noqa: SIM118 - keys() is under test
    assert view.refusal(key) is None
    assert view.scheme(key) == scheme
    assert view.shape(key) == tuple(case.reference.shape)
    assert view.dtype(key) == "F32"
    got = view.read(key)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    # Exact but for the last bit where a library multiplies its factors in another order.
    torch.testing.assert_close(got, case.reference, rtol=1e-6, atol=0)
    assert_covers(view, set(case.tensors))
    # Staging reads it whole (in_memory), or into a buffer of nbytes.
    assert view.in_memory(key)
    assert view.nbytes(key) == got.numel() * 4
    buffer = torch.empty(view.nbytes(key) + 16, dtype=torch.uint8)
    torch.testing.assert_close(view.read_into(key, buffer), got, rtol=0, atol=0)
    view.close()


def test_the_same_scheme_without_config_reads_the_same(tmp_path: Path) -> None:
    """GPTQ and AWQ are told apart by their tensors' shapes: the config only breaks ties.
    GPTQ's g_idx says where each group begins; AWQ's groups without the config's group_size
    could be of several sizes, so that weight is refused, never guessed."""
    case = q.gptq()
    _, view = view_of(tmp_path / "gptq", case.tensors, None)
    torch.testing.assert_close(view.read(case.key), case.reference, rtol=0, atol=0)
    assert view.scheme(case.key) == case.scheme
    case = q.awq()
    _, view = view_of(tmp_path / "awq", case.tensors, None)
    why = view.refusal(case.key)
    assert why is not None and "no group_size" in why


def _ct_stack(experts: int = 3) -> q.Quantized:
    """A (E, out, in) stack of compressed-tensors int4 experts, each compressed by the
    library, stacked as a fused-experts checkpoint stores them."""
    parts = [q.compressed("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                             "group_size": 32, "symmetric": False},
                          (40, 64), seed=e) for e in range(experts)]
    tensors = {k: torch.stack([p.tensors[k] for p in parts]) for k in parts[0].tensors
               if not k.endswith("weight_shape")}
    tensors["layer.weight_shape"] = torch.tensor([experts, 40, 64])
    return q.Quantized(tensors, parts[0].config, torch.stack([p.reference for p in parts]),
                       "compressed-int4-g32")


@pytest.mark.parametrize("build", [
    lambda: q.fp8_blocks((3, 150, 200)),
    lambda: q.gpt_oss(),
    _ct_stack,
    lambda: q.fp8_fused_experts(),
], ids=["fp8-block-experts", "gpt-oss-mxfp4", "compressed-int4-experts", "fp8-fused-experts"])
def test_read_row_is_one_expert_of_the_stack(build: Callable[[], q.Quantized],
                                             tmp_path: Path) -> None:
    if build is _ct_stack:
        needs("compressed-")
    case = build()
    _, view = view_of(tmp_path, case.tensors, case.config)
    whole = view.read(case.key)
    torch.testing.assert_close(whole, case.reference, rtol=1e-6, atol=0)
    for index in range(whole.shape[0]):
        torch.testing.assert_close(view.read_row(case.key, index), whole[index], rtol=0, atol=0)
    assert view.scheme(case.key) == case.scheme
    assert_covers(view, set(case.tensors))
    if "down" in case.extra:  # a second fused parameter of the same module
        torch.testing.assert_close(view.read("mlp.experts.down_proj"), case.extra["down"],
                                   rtol=1e-6, atol=0)
        assert view.refusal("mlp.experts.down_proj") is None
        assert "mlp.experts.down_proj_bias" in view.keys()  # noqa: SIM118 - under test


def _gptq_3bit() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """GPTQ 3-bit shapes: 64 inputs in 6 rows of words, 64 outputs' zeros in 6 columns."""
    return ({"layer.qweight": torch.zeros(6, 64, dtype=torch.int32),
             "layer.qzeros": torch.zeros(2, 6, dtype=torch.int32),
             "layer.scales": torch.ones(2, 64, dtype=torch.float16),
             "layer.g_idx": (torch.arange(64) // 32).to(torch.int32)},
            {"quant_method": "gptq", "bits": 3, "group_size": 32})


def _missing(case: q.Quantized, *names: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in case.tensors.items() if k.rpartition(".")[2] not in names}


# name -> (tensors, quantization_config, the refused key, its logical shape, words of the line)
REFUSALS: dict[str, Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any] | None,
                                       str, tuple[int, ...], str]]] = {
    "gptq-3bit": lambda: (*_gptq_3bit(), "layer.weight", (64, 64), "3-bit GPTQ"),
    "gptq-no-scales": lambda: (_missing(q.gptq(), "scales"), q.gptq().config, "layer.weight",
                               (64, 96), "no scales"),
    "gptq-marlin-format": lambda: (q.gptq().tensors, {**(q.gptq().config or {}),
                                                      "checkpoint_format": "marlin"},
                                   "layer.weight", (64, 96), "marlin"),
    "awq-gemv": lambda: (q.awq().tensors, {**(q.awq().config or {}), "version": "gemv"},
                         "layer.weight", (64, 96), "gemv"),
    "fp8-without-scale": lambda: ({"layer.weight": torch.randn(32, 48).to(torch.float8_e4m3fn)},
                                  None, "layer.weight", (32, 48), "no scale"),
    "fp8-scale-that-fits-no-grid": lambda: (
        {"layer.weight": torch.randn(32, 48).to(torch.float8_e4m3fn),
         "layer.weight_scale_inv": torch.ones(5, 7)},
        {"quant_method": "fp8", "weight_block_size": [16, 16]}, "layer.weight", (32, 48),
        "does not fit"),
    "bnb4-without-quant-state": lambda: (
        _missing(q.bnb4(), "bitsandbytes__nf4"), q.bnb4().config, "layer.weight", (1440, 1),
        "quant_state"),
    "unknown-method": lambda: (
        {"layer.weight": torch.randint(-8, 8, (32, 48), dtype=torch.int8),
         "layer.weight_scales": torch.ones(48)},
        {"quant_method": "eetq"}, "layer.weight", (32, 48), "eetq"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refused_weights_keep_their_key_with_one_line(name: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    needs(name)
    tensors, config, key, shape, words = REFUSALS[name]()
    with caplog.at_level(logging.WARNING, logger="esd_worker.analysis.quant.view"):
        checkpoint, view = view_of(tmp_path, tensors, config)
    assert [r.getMessage() for r in caplog.records if words in r.getMessage()], caplog.text
    assert view is not checkpoint
    why = view.refusal(key)
    assert why is not None and words in why and "\n" not in why, why
    assert key in view.keys() and view.shape(key) == shape  # noqa: SIM118 - keys() under test
    assert view.scheme(key) is None
    # Never the stored values as floats: a placeholder that the analysis gives a status row.
    placeholder = view.read(key)
    assert not placeholder.is_floating_point() and tuple(placeholder.shape) == shape
    assert view.dtype(key) != "F32"
    assert_covers(view, set(tensors))


def test_a_dense_checkpoint_is_handed_back_as_it_is(tmp_path: Path) -> None:
    import json

    model = make_llama(tmp_path / "llama")
    config = json.loads((model / "config.json").read_text())
    with Checkpoint(model) as checkpoint:
        assert dequantized(checkpoint, config, model) is checkpoint
        assert dequantized(checkpoint, None, model) is checkpoint


def test_integer_tensors_without_quantization_are_read_as_stored(tmp_path: Path) -> None:
    """An int8 weight with nothing beside it and no quantization_config is no quantized
    weight this code knows: it passes through (the analysis' unsupported_dtype row)."""
    tensors = {"layer.weight": torch.ones(16, 16, dtype=torch.int8),
               "layer.bias": torch.zeros(16), "norm.weight": torch.ones(16)}
    checkpoint, view = view_of(tmp_path, tensors, None)
    assert view is checkpoint


def test_mixed_checkpoint_passes_unquantized_tensors_through(tmp_path: Path) -> None:
    """Quantized projections beside float embeddings, norms and an unquantized head (the
    config's `ignore`): the float ones are read as stored, in the checkpoint's order."""
    case = q.fp8_blocks((64, 48), block=(32, 32), module="model.layers.0.mlp.up_proj")
    float_tensors = {"model.embed_tokens.weight": torch.randn(10, 48),
                     "model.norm.weight": torch.ones(48), "lm_head.weight": torch.randn(10, 48)}
    _, view = view_of(tmp_path, case.tensors | float_tensors, case.config)
    assert view.keys() == ["lm_head.weight", "model.embed_tokens.weight",
                           "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    for key, tensor in float_tensors.items():
        assert view.scheme(key) is None and view.refusal(key) is None
        assert view.dtype(key) == "F32" and not view.in_memory(key)
        torch.testing.assert_close(view.read(key), tensor, rtol=0, atol=0)
        assert view.nbytes(key) == tensor.numel() * 4
    assert view.folded() == {"model.layers.0.mlp.up_proj.weight_scale_inv":
                             "model.layers.0.mlp.up_proj.weight"}
    assert math.prod(view.shape("model.layers.0.mlp.up_proj.weight")) == 64 * 48


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, -1])
def test_unpacking_by_bytes_equals_unpacking_by_words(bits: int, dim: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The little-endian byte-plane path and the word-shift path (any byte order) agree,
    in order and in AWQ's order."""
    from esd_worker.analysis.quant.plan import unpack

    words = torch.randint(-(2**31), 2**31 - 1, (6, 5), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(bits))
    order = q.AWQ_ORDER if bits == 4 else None
    fast = [unpack(words, bits, dim=dim), unpack(words, bits, dim=dim, order=order)]
    monkeypatch.setattr("sys.byteorder", "big")
    slow = [unpack(words, bits, dim=dim), unpack(words, bits, dim=dim, order=order)]
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b) and a.is_contiguous()
    # value j of word w is element w * (32 // bits) + j along `dim`
    first = int(words[0, 0]) & 0xFFFFFFFF
    along = slow[0][:, 0] if dim == 0 else slow[0][0]
    assert [int(v) for v in along[: 32 // bits]] == [
        (first >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]


@pytest.mark.parametrize(("n", "count", "hints", "size"), [
    (256, 2, [128], 128),  # the config's (or FP8's usual) block where it fits
    (200, 4, [64], 64),  # a partial last block, as the config says
    (200, 4, [], None),  # 50 or 64 (last partial): the shapes cannot tell, so no guess
    (96, 2, [], None),  # GPTQ groups of 48 or 64
    (48, 48, [], 1),  # one scale a row: only blocks of 1 give 48
    (100, 1, [], 100),  # one scale for the whole axis
    (3, 2, [], 2),  # only blocks of 2 give 2
])
def test_a_block_size_is_given_or_the_only_one_that_fits(
        n: int, count: int, hints: list[int], size: int | None) -> None:
    from esd_worker.analysis.quant.plan import block_size

    assert block_size(n, count, hints) == size
