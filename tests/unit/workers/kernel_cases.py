"""Run under TRITON_INTERPRET=1: the Triton region affinity against the PyTorch reference.

Prints one JSON object: for each case the largest forward and gradient differences, and for a
short VSRN run with gcn_kernel=torch vs triton the losses and the largest parameter difference.
Used by tests/unit/test_region_affinity_kernel.py (the interpreter must be on before Triton
compiles anything, so it runs in its own process).
"""

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from vldist.kernels.region_affinity import region_affinity, region_affinity_torch  # noqa: E402

CASES = [  # (B, K, D, normalize, mask kind)
    (2, 1, 16, "count", "none"),
    (2, 1, 16, "softmax", "random"),
    (3, 5, 40, "count", "random"),
    (3, 5, 40, "softmax", "random"),
    (2, 7, 70, "count", "none"),
    (2, 7, 70, "softmax", "none"),
    (3, 9, 64, "count", "padded_image"),
    (3, 9, 64, "softmax", "padded_image"),
    (2, 36, 48, "count", "random"),
    (2, 36, 48, "softmax", "random"),
    (1, 128, 32, "softmax", "random"),
]


def case(B, K, D, normalize, mask_kind, seed, dtype=torch.float32):
    """Largest differences to the fp32 reference on the same (rounded) inputs, over its scale."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(B, K, D, generator=gen).to(dtype).requires_grad_() for _ in range(3)]
    theta, phi, g = [x.detach().float().requires_grad_() for x in inputs]
    mask = None
    if mask_kind != "none":
        mask = torch.rand(B, K, generator=gen) > 0.3
        mask[:, 0] = True
        if mask_kind == "padded_image":
            mask[-1] = False  # an image with no region at all
    ref = region_affinity_torch(theta, phi, g, normalize, mask)
    dy = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad(ref, (theta, phi, g), dy)
    out = region_affinity(*inputs, normalize, mask, kernel="triton")
    grads = torch.autograd.grad(out, inputs, dy.to(dtype))
    out, grads = out.float(), [x.float() for x in grads]
    scale = max(float(ref.abs().max()), 1e-6)
    return {
        "case": [B, K, D, normalize, mask_kind],
        "forward": float((out - ref).abs().max()) / scale,
        "grads": [
            float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6) for a, b in zip(grads, ref_grads, strict=True)
        ],
    }


def vsrn_run(kernel: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "workers"))
    import equivalence_step as worker

    recipe = worker.make_recipe(True, f"model.gcn_kernel={kernel}", "model.affinity_norm=softmax")
    model = worker.build_model(recipe)
    # SGD: Adam would blow float noise in gradients that are zero in theory up to full lr-sized steps
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    batch = recipe.collate_train(worker.global_samples())
    losses = []
    for _ in range(3):
        loss = recipe.training_losses(model, batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


if __name__ == "__main__":
    results = [case(*c, seed=i) for i, c in enumerate(CASES)]
    # fp16 only: the interpreter's bf16 dot products are wrong (a plain 16x16 bf16 tl.dot is off
    # by 3e10 here), so bf16 is checked on CUDA only
    half = [case(*c, seed=i, dtype=torch.float16) for i, c in enumerate(CASES[2:9:3])]
    torch_run, triton_run = vsrn_run("torch"), vsrn_run("triton")
    diff = max(float((triton_run["params"][n] - p).abs().max()) for n, p in torch_run["params"].items())
    print(
        json.dumps(
            {
                "cases": results,
                "fp16": half,
                "vsrn": {"torch": torch_run["losses"], "triton": triton_run["losses"], "max_param_diff": diff},
            }
        )
    )
