"""bench/reasoning_identity.py: the branch/input ratio and gamma of the reasoning layers, measured
with forward hooks, against the branch run by hand."""

import torch
from helpers import bench_module

from vldist.data.vocab import Vocab
from vldist.kernels import region_affinity_torch
from vldist.models.common import l2norm
from vldist.recipes.jobs import load_config
from vldist.recipes.l2c import L2CConfig, L2CModel
from vldist.recipes.vsrn import VSRNModel

ri = bench_module("reasoning_identity")

VOCAB = Vocab(["a", "red", "circle"])
F_DIM, D = 6, 8


def _vsrn(rrr_layers=2):
    config = load_config(
        "vsrn",
        [
            "model.embed_size=8",
            "model.word_dim=4",
            "model.decoder_hidden=8",
            f"model.rrr_layers={rrr_layers}",
            "model.gcn_kernel=torch",
        ],
    )
    torch.manual_seed(0)
    return VSRNModel(config.model, F_DIM, len(VOCAB))


def _batches():
    torch.manual_seed(1)
    out = []
    for counts in ([2, 5, 3], [4, 1, 5]):
        regions = torch.randn(len(counts), 5, F_DIM)  # padded rows hold noise: they must not count
        mask = torch.arange(5)[None] < torch.tensor(counts)[:, None]
        out.append({"regions": regions, "mask": mask})
    return out


def _measure(model, batches):
    return ri.measure(model, batches, ri.forward_fn("vsrn", model, torch.device("cpu")))


def test_fresh_model_is_the_identity_ratio_and_gamma_zero():
    model = _vsrn()
    result = _measure(model, _batches())
    assert list(result["layers"]) == ["image.rrr.0", "image.rrr.1"]
    for row in result["layers"].values():
        assert row["gamma_mean_abs"] == 0 and row["gamma_max_abs"] == 0 and row["beta_mean_abs"] == 0
        for mode in ("running", "batch"):
            assert row[mode]["branch_ratio_mean"] == 0 and row[mode]["branch_ratio_max"] == 0
            assert row[mode]["branch_no_beta_ratio_mean"] == 0
            assert row[mode]["samples"] == 6
    assert result["skip_all_change"] == {"running": {"mean": 0, "max": 0}, "batch": {"mean": 0, "max": 0}}
    assert result["regions_seen"] == {"mean": 20 / 6, "min": 1, "max": 5, "images": 6}
    assert model.training  # restored


def _moved_second_layer():
    model = _vsrn()
    layer = model.image.rrr[1]
    with torch.no_grad():  # layer 0 stays the identity, so layer 1's input is the projected regions
        layer.bn.weight.fill_(0.5)
        layer.bn.bias.copy_(0.01 * torch.randn(D))
        layer.bn.running_mean.copy_(torch.randn(D))
        layer.bn.running_var.copy_(torch.rand(D) + 0.5)
    return model, layer


@torch.no_grad()
def _by_hand(model, layer, batches, batch_stats: bool) -> tuple[list[float], list[float]]:
    """Per sample ||BN(W_r(R g(V)))|| / ||V|| over its real regions, and the same without beta."""
    bn, ratios, no_beta = layer.bn, [], []
    for batch in batches:
        regions, mask = batch["regions"], batch["mask"]
        v = l2norm(model.image.region_projection(regions)) * mask.unsqueeze(-1)
        theta, phi, g = layer.theta_phi_g(v).chunk(3, dim=-1)
        x = layer.w_r(region_affinity_torch(theta, phi, g, "count", mask))
        if batch_stats:  # over the batch's real regions only, biased variance (BN's normalisation)
            mean, var = x[mask].mean(dim=0), x[mask].var(dim=0, unbiased=False)
        else:
            mean, var = bn.running_mean, bn.running_var
        normed = (x - mean) / torch.sqrt(var + bn.eps)
        for b in range(len(regions)):
            real = mask[b]
            inp = v[b, real].norm()
            ratios.append(((bn.weight * normed[b, real] + bn.bias).norm() / inp).item())
            no_beta.append(((bn.weight * normed[b, real]).norm() / inp).item())
    return ratios, no_beta


def test_ratio_equals_the_branch_run_by_hand():
    model, layer = _moved_second_layer()
    batches = _batches()
    buffers = {k: v.clone() for k, v in layer.bn.named_buffers()}
    result = _measure(model, batches)
    row = result["layers"]["image.rrr.1"]
    assert row["gamma_mean_abs"] == 0.5 and row["gamma_max_abs"] == 0.5
    assert result["layers"]["image.rrr.0"]["running"]["branch_ratio_mean"] == 0
    for mode in ("running", "batch"):
        ratios, no_beta = _by_hand(model, layer, batches, batch_stats=mode == "batch")
        measured = row[mode]
        assert abs(measured["branch_ratio_mean"] - sum(ratios) / len(ratios)) < 1e-5
        assert abs(measured["branch_ratio_max"] - max(ratios)) < 1e-5
        assert abs(measured["branch_no_beta_ratio_mean"] - sum(no_beta) / len(no_beta)) < 1e-5
        assert measured["branch_ratio_mean"] > 0.01
        assert result["skip_all_change"][mode]["mean"] > 0
    # the batch-statistics pass leaves the running statistics as they were
    for k, v in layer.bn.named_buffers():
        assert torch.equal(v, buffers[k])


def test_l2c_relation_gcn_unmasked_nodes():
    cfg = L2CConfig(graph_dim=D, hidden=8, embed=8, classes=3, gcn_layers=1, gcn_kernel="torch")
    torch.manual_seed(0)
    model = L2CModel(cfg, len(VOCAB))
    batch = {"images": torch.randn(2, 3, 32, 32), "second": torch.randn(2, 3, 32, 32)}
    forward = ri.forward_fn("l2c", model, torch.device("cpu"))
    fresh = ri.measure(model, [batch], forward)
    assert fresh["layers"]["encoder.gcn.0"]["running"]["branch_ratio_mean"] == 0
    assert fresh["regions_seen"] == {"mean": 3.0, "min": 3, "max": 3, "images": 4}  # both images of 2 pairs
    with torch.no_grad():
        model.encoder.gcn[0].bn.weight.fill_(1.0)
    moved = ri.measure(model, [batch], forward)["layers"]["encoder.gcn.0"]
    assert moved["gamma_mean_abs"] == 1.0
    for mode in ("running", "batch"):
        assert moved[mode]["branch_ratio_mean"] > 0
        assert moved[mode]["branch_ratio_mean"] == moved[mode]["branch_no_beta_ratio_mean"]  # beta still 0
