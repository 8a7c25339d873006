"""Seconds of each piece of the captioner demo's test evaluation (jobs/captioner.yaml on shards/synth).

    PYTHONPATH=$PWD python bench/caption_eval_speed.py --save /tmp/after.pt
    PYTHONPATH=../before python bench/caption_eval_speed.py --save /tmp/before.pt    # a checkout of the code before
    python bench/caption_eval_speed.py --compare /tmp/before.pt /tmp/after.pt

The pieces are those of CaptionerRecipe.evaluate, timed apart: beam-search generation over the test
split (eval.beam_size), self-retrieval scoring (ln p(caption | image) for the eval.self_retrieval_pool
first images x their captions, through the decoder), pycocoevalcap's caption metrics, and the
self-retrieval recall. The model is the demo's untrained one (seed 0, what the "untrained"
evaluation runs), or a trained one from --checkpoint (a run directory or checkpoint).

The vldist on PYTHONPATH is measured, so the same script times main's code and a branch's.
--save writes the captions and the score matrix; --compare checks two saved files agree (the same
captions, metrics; the scores within float tolerance, where both sides scored the pair: self-retrieval
scoring leaves -inf where a pair cannot outscore its caption's own image).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def load_model(checkpoint: str | None, overrides: list[str]):
    from vldist.data.job_shards import open_job_shards
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    if checkpoint:
        from vldist.checkpoint.trained_model import load_checkpoint

        config, recipe, model, shards = load_checkpoint(checkpoint, device="cpu")
        return config, recipe, model, shards
    config = load_config("captioner", ["output.dir=/tmp/caption_eval_speed", *overrides])
    recipe_cls = get_recipe(config.recipe)
    shards = open_job_shards(config, recipe_cls).main
    vocab = shards.vocab(config.output_dir, config.data.vocab_min_count, ())
    recipe = recipe_cls(config, vocab, shards.feature_dim())
    torch.manual_seed(config.seed)
    model = recipe.build_model()
    return config, recipe, model.eval(), shards


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(args) -> dict:
    from vldist.data.collate import pad_tokens
    from vldist.metrics import caption_scores, self_retrieval_recall
    from vldist.models import caption_scoring
    from vldist.models.generation import generate
    from vldist.recipes.captioner import _trim
    from vldist.training.split_evaluation import eval_loader

    config, recipe, model, shards = load_model(args.checkpoint, args.override)
    decoder, vocab = model.decoder, recipe.vocab
    batches = list(eval_loader(config, recipe, shards, config.eval.split))
    pool = args.pool or config.eval.self_retrieval_pool

    def generation():
        return [
            generate(
                decoder,
                b["regions"],
                b["mask"],
                vocab.start_id,
                vocab.end_id,
                recipe.max_generated_len,
                config.eval.beam_size,
            )
            for b in batches
        ]

    ids, seconds_generation = timed(generation)
    references = {k: r for b in batches for k, r in zip(b["keys"], b["references"], strict=True)}
    generated = {
        k: c for b, i in zip(batches, ids, strict=True) for k, c in zip(b["keys"], recipe.decode(i), strict=True)
    }
    # The pool as CaptionerRecipe.evaluate builds it: the first `pool` images and their captions.
    regions = torch.cat([b["regions"] for b in batches])[:pool]
    mask = torch.cat([b["mask"] for b in batches])[:pool]
    tokens, _ = pad_tokens([[vocab.start_id, *row] for i in ids for row in _trim(i)][:pool], vocab.pad_id)
    # what CaptionerRecipe.evaluate runs; a checkout from before self_retrieval_logprobs scores every pair
    score = getattr(caption_scoring, "self_retrieval_logprobs", caption_scoring.caption_image_logprobs)
    logp, seconds_scoring = timed(lambda: score(decoder, regions, mask, tokens, vocab.pad_id))
    ks = [k for k in (1, 5, 50, 500) if k < logp.shape[0]]
    recall, seconds_recall = timed(lambda: self_retrieval_recall(logp, ks))
    scores, seconds_metrics = timed(lambda: caption_scores(references, generated))
    return {
        "threads": torch.get_num_threads(),
        "images": len(generated),
        "pool": int(logp.shape[0]),
        "scored_tokens": list(tokens.shape),
        "seconds": {
            "generation": round(seconds_generation, 2),
            "self_retrieval_scoring": round(seconds_scoring, 2),
            "caption_metrics": round(seconds_metrics, 2),
            "self_retrieval_recall": round(seconds_recall, 3),
        },
        "captions": scores,
        "self_retrieval": recall,
        "_generated": generated,
        "_logp": logp,
    }


def logp_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the entries both score; inf if one side dropped (-inf) an entry that
    the other scores at or above its caption's own image (self-retrieval drops only those below)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    for dropped, other in ((~torch.isfinite(a), b), (~torch.isfinite(b), a)):
        own = other.diag()[:, None].expand_as(other)
        if (dropped & torch.isfinite(other) & (other >= own)).any():
            return float("inf")
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def compare(a_path: str, b_path: str, atol: float) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    same_captions = a["_generated"] == b["_generated"]
    diff = logp_difference(a["_logp"], b["_logp"])
    print(f"same captions: {same_captions}; same caption metrics: {a['captions'] == b['captions']}")
    print(f"same self-retrieval: {a['self_retrieval'] == b['self_retrieval']}; max |logp diff| {diff:.3g}")
    if not (same_captions and a["captions"] == b["captions"] and a["self_retrieval"] == b["self_retrieval"]):
        raise SystemExit("results differ")
    if not diff <= atol:
        raise SystemExit(f"scores differ by more than {atol}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a trained captioner (run directory or checkpoint); default: untrained")
    parser.add_argument("--override", action="append", default=[], help="job override key=value (untrained only)")
    parser.add_argument("--pool", type=int, help="self-retrieval pool (default: the job's eval.self_retrieval_pool)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--save", help="write the results (captions, score matrix) to this .pt file")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="check two --save files agree, then exit")
    parser.add_argument("--atol", type=float, default=1e-3, help="--compare: largest |logp difference| allowed")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare, args.atol)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    if args.save:
        torch.save(result, args.save)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}, indent=1))


if __name__ == "__main__":
    main()
