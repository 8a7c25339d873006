"""LAViTeR's Table 2 in miniature, on the embedded scenes: R-precision and AIMCoS per variant.

    python bench/laviter_ablation.py [--root runs/laviter_ablation] [--seeds 0 1 2] [--samples 1500]
                                     [--rows full vta-frozen]

Each row is one run per seed of jobs/laviter.yaml with the overrides below (its phases as stages,
each its own process's stage), scored on the 1,000 test images. Every row trains the alignment
(DAMSM) for the same epochs, vta_epochs + joint_epochs; the assisting rows add phase 2, which
trains only their generator and/or captioner on the frozen encoders:

    damsm-bilstm    AttnGAN's DAMSM: the bi-LSTM text encoder, E_I's trunk frozen throughout
    vta-frozen      VTA only, E_I's trunk frozen throughout (the transformer text encoder)
    vta-trainable   VTA only, then phase 3 with DAMSM alone: E_I's later blocks train
    itm             + image-to-text: phases 1-3 with the captioner (L_C, L_FT), no generator
    tim             + text-to-image: phases 1-3 with the GAN (L_G, L_FI), no captioner
    full            LAViTeR: both

The paper (COCO, R-precision % / AIMCoS): DAMSM 89.97 / 0.44; VTA frozen 89.81 / 0.501; VTA
trainable 90.37 / 0.5059; + image-to-text 90.14 / 0.506; + text-to-image 90.43 / 0.504; full
90.71 / 0.5063. A run whose metrics.json exists is kept, so an interrupted bench resumes. Prints
a markdown table (mean ± sample std over seeds) and writes it with the raw numbers to
<root>/ablation.json.
"""

from __future__ import annotations

from ablation_runs import ablation_parser, markdown_table, mean_std, report, train_once

VTA_ONLY = ["model.tim=false", "model.itm=false"]
ROWS = [
    ("damsm-bilstm", "DAMSM (bi-LSTM text encoder), trunk frozen", ["model.text_encoder=bilstm", *VTA_ONLY]),
    ("vta-frozen", "VTA only, trunk frozen", VTA_ONLY),
    ("vta-trainable", "VTA only, trunk trainable (phase 3)", VTA_ONLY),
    ("itm", "+ image-to-text", ["model.tim=false"]),
    ("tim", "+ text-to-image", ["model.itm=false"]),
    ("full", "LAViTeR (full)", []),
]
FROZEN_THROUGHOUT = ("damsm-bilstm", "vta-frozen")


def table(results: dict[str, list[dict]]) -> str:
    head = ["model", "R-precision@1 (%)", "R-precision@3 (%)", "AIMCoS", "rsum", "R@1 per seed"]
    rows = []
    for label, runs in results.items():
        cells = [mean_std([r["r_precision"]["r1"] for r in runs]), mean_std([r["r_precision"]["r3"] for r in runs]),
                 mean_std([r["aimcos"] for r in runs], digits=3), mean_std([r["retrieval"]["rsum"] for r in runs])]
        per_seed = " / ".join(f"{r['r_precision']['r1']:.1f}" for r in runs)
        rows.append([label, *cells, per_seed])
    return markdown_table(head, rows)


def main() -> None:
    parser = ablation_parser(__doc__, "laviter_ablation", [key for key, _, _ in ROWS])
    parser.add_argument("--samples", type=int, default=1500, help="train.samples_per_epoch (the set has 5,000)")
    parser.add_argument("--vta-epochs", type=int, default=2)
    parser.add_argument("--assist-epochs", type=int, default=1)
    parser.add_argument("--joint-epochs", type=int, default=1)
    args = parser.parse_args()
    root = args.root.resolve()
    common = ["metrics.enabled=false", "eval.baseline=false", "model.caption_metrics=false", "model.grid=0",
              f"train.samples_per_epoch={args.samples}", f"model.assist_epochs={args.assist_epochs}"]

    results: dict[str, list[dict]] = {}
    raw: dict = {"seeds": args.seeds, "samples_per_epoch": args.samples, "runs": {}}
    for seed in args.seeds:
        for key, label, overrides in ROWS:
            if key not in args.rows:
                continue
            if key in FROZEN_THROUGHOUT:  # the same DAMSM epochs, all in phase 1
                epochs = [f"model.vta_epochs={args.vta_epochs + args.joint_epochs}", "model.joint_epochs=0"]
                last = "vta"
            else:
                epochs = [f"model.vta_epochs={args.vta_epochs}", f"model.joint_epochs={args.joint_epochs}"]
                last = "joint"
            metrics, seconds = train_once("laviter", root / key / f"seed{seed}",
                                          [*overrides, *epochs, f"seed={seed}", *common], f"{last}/metrics.json")
            results.setdefault(label, []).append(metrics["test"])
            raw["runs"][f"{key}/seed{seed}"] = {"test": metrics["test"], "seconds": seconds, "overrides": overrides}
            print(f"{label}, seed {seed}: R-precision@1 {metrics['test']['r_precision']['r1']:.1f}, "
                  f"AIMCoS {metrics['test']['aimcos']:.3f}", flush=True)

    report(root, table(results), raw)


if __name__ == "__main__":
    main()
