import pytest
import torch

from slimlm.compress.gptq import gptq_quantize
from slimlm.compress.rtn import dequantize_weight, quantize_rtn
from slimlm.compress.sparsity import (
    SparsityPattern,
    keep_mask,
    magnitude_mask,
    outlier_ratio,
    owl_ratios,
    sparsegpt_prune,
    wanda_mask,
)
from slimlm.errors import ConfigError, SlimlmError
from slimlm.qlinear import QuantScheme
from tests.test_gptq import correlated_inputs, hessian_of

UNSTRUCTURED_50 = SparsityPattern.parse(0.5, "unstructured")
TWO_FOUR = SparsityPattern.parse(0.5, "2:4")


def layer(rows=48, cols=64, seed=1):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def output_error(x, weight, approximation):
    return float(((x @ weight.T - x @ approximation.T) ** 2).mean())


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 0.77])
def test_unstructured_masks_drop_exactly_the_ratio(ratio):
    weight, pattern = layer(), SparsityPattern.parse(ratio, "unstructured")
    assert int((~magnitude_mask(weight, pattern)).sum()) == int(ratio * weight.numel())
    per_row = (~wanda_mask(weight, torch.rand(64), pattern)).sum(dim=1)
    assert torch.all(per_row == int(ratio * 64))  # Wanda compares within each output row
    pruned = sparsegpt_prune(weight, hessian_of(correlated_inputs()), pattern, block_size=24)
    assert int((pruned == 0).sum()) == int(ratio * weight.numel())


@pytest.mark.parametrize("pattern, sparsity", [("2:4", 0.5), ("4:8", 0.5), ("1:4", 0.75)])
def test_nm_masks_keep_exactly_n_in_every_m(pattern, sparsity):
    nm = SparsityPattern.parse(sparsity, pattern)
    weight, x = layer(), correlated_inputs()
    for keep in (
        magnitude_mask(weight, nm),
        wanda_mask(weight, torch.rand(64), nm),
        sparsegpt_prune(weight, hessian_of(x), nm, block_size=20) != 0,
    ):
        assert torch.all(keep.reshape(48, -1, nm.m).sum(dim=-1) == nm.n)


def test_magnitude_keeps_the_largest_weights():
    weight = torch.tensor([[0.1, -3.0, 2.0, -0.2], [5.0, 0.01, -0.5, 0.3]])
    assert magnitude_mask(weight, TWO_FOUR).tolist() == [
        [False, True, True, False],
        [True, False, True, False],
    ]


def test_wanda_weighs_weights_by_input_norm():
    weight = torch.ones(2, 4)
    keep = wanda_mask(weight, torch.tensor([1.0, 9.0, 4.0, 0.25]), TWO_FOUR)  # ||X_j|| = 1, 3, 2, 0.5
    assert keep.tolist() == [[False, True, True, False]] * 2


@pytest.mark.parametrize("pattern", [UNSTRUCTURED_50, TWO_FOUR], ids=str)
def test_sparsegpt_lowers_output_error_against_magnitude_and_wanda(pattern):
    x = correlated_inputs()
    weight, hessian = layer(), hessian_of(x)
    magnitude = output_error(x, weight, weight * magnitude_mask(weight, pattern))
    wanda = output_error(x, weight, weight * wanda_mask(weight, hessian.diagonal(), pattern))
    sparsegpt = output_error(x, weight, sparsegpt_prune(weight, hessian, pattern, block_size=32))
    assert wanda < magnitude and sparsegpt < 0.6 * magnitude and sparsegpt < wanda


def test_sparsegpt_blocks_only_change_the_mask_choice_not_the_update():
    """With a fixed N:M pattern chosen per run of M columns, block size changes nothing."""
    x, weight = correlated_inputs(), layer()
    results = [sparsegpt_prune(weight, hessian_of(x), TWO_FOUR, block_size=b) for b in (8, 32, 64)]
    for other in results[1:]:
        torch.testing.assert_close(results[0], other, rtol=1e-4, atol=1e-5)


def test_owl_ratios_average_the_target_and_follow_outliers():
    ratios = owl_ratios([0.01, 0.05, 0.03, 0.01], target=0.5, spread=0.08)
    assert sum(ratios) / 4 == pytest.approx(0.5)
    assert ratios[1] == min(ratios) and max(ratios) - min(ratios) == pytest.approx(0.16)
    assert owl_ratios([0.02, 0.02], 0.6, 0.08) == pytest.approx([0.6, 0.6])
    assert outlier_ratio([torch.tensor([1.0, 1.0, 1.0, 100.0])], threshold=2.0) == 0.25


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(bits=4, group_size=16), QuantScheme(bits=3, group_size=32, symmetric=False)],
    ids=str,
)
def test_quantizing_a_pruned_weight_keeps_its_zeros(scheme):
    x, weight = correlated_inputs(), layer()
    pruned = sparsegpt_prune(weight, hessian_of(x), TWO_FOUR)
    for quantized in (quantize_rtn(pruned, scheme), gptq_quantize(pruned, hessian_of(x), scheme)):
        restored = dequantize_weight(quantized, scheme)
        assert torch.all(restored[pruned == 0] == 0)
        assert (restored[pruned != 0] != 0).float().mean() > 0.8  # survivors mostly round to nonzero codes


def test_bad_patterns_are_refused():
    for sparsity, pattern in [
        (1.0, "unstructured"),
        (-0.1, "unstructured"),
        (0.5, "4:2"),
        (0.5, "2-4"),
        (1.0, "0:4"),
    ]:
        with pytest.raises(ConfigError):
            SparsityPattern.parse(sparsity, pattern)
    with pytest.raises(SlimlmError, match="not a multiple of 8"):
        sparsegpt_prune(torch.randn(4, 12), torch.eye(12), SparsityPattern.parse(0.5, "4:8"))
    with pytest.raises(ConfigError, match="disagrees with pattern '2:4'"):
        SparsityPattern.parse(0.7, "2:4")
    assert keep_mask(torch.rand(3, 8), SparsityPattern.parse(0.0, "unstructured"), per_row=True).all()


def test_sparsify_stage_refuses_a_pattern_the_layers_cannot_take_before_touching_them(
    tiny_model, tiny_tokenizer, tmp_path
):
    from slimlm.compress.sparsify import SparsifyParams
    from slimlm.compress.sparsify import run as sparsify
    from slimlm.pipeline import RunState

    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=tiny_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with pytest.raises(SlimlmError, match=r"cannot sparsify model\.layers\.0\..*not a multiple of 7"):
        sparsify(state, SparsifyParams(method="magnitude", sparsity=4 / 7, pattern="3:7"))
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    with pytest.raises(ConfigError, match="owl"):
        SparsifyParams(method="magnitude", owl=True)
    with pytest.raises(ConfigError, match="unknown"):
        SparsifyParams(method="random")


def test_two_four_detection_chooses_the_semi_structured_kernel_only_where_it_runs():
    from slimlm.inference.linear import is_two_four, semi_sparse_fits

    weight = layer(rows=64, cols=128)
    pruned = weight * magnitude_mask(weight, TWO_FOUR)
    assert is_two_four(pruned) and not is_two_four(weight)
    assert not is_two_four(
        weight * magnitude_mask(weight, UNSTRUCTURED_50)
    )  # 50% overall is not 2 in every 4
    assert not semi_sparse_fits(
        pruned, torch.bfloat16, torch.device("cpu")
    )  # CPUs have no sparse tensor cores: dense kernel


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="needs a GPU with sparse tensor cores",
)
def test_semi_structured_kernel_matches_the_dense_product_on_gpu():
    from slimlm.inference.linear import SemiSparseLinear

    weight = layer(rows=128, cols=256).cuda().half()
    pruned = weight * magnitude_mask(weight.float(), TWO_FOUR).cuda().half()
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(
        SemiSparseLinear(pruned, None, torch.float16, torch.device("cuda"))(x),
        x @ pruned.T,
        rtol=2e-2,
        atol=2e-2,
    )
