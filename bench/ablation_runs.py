"""What the ablation benches share: one training run per process, kept once finished; the results
file each bench commits (docs/results/<method>_ablation.json); the tables built from it.

A bench trains each (row, seed) as `python -m vldist.train JOB ... output.dir=<root>/<row>/seed<k>`,
in its own process, unless that run finished before (an interrupted bench resumes; a second
invocation with the same seeds regenerates the results without training). It then writes the
numbers its tables use to `--results` (default docs/results/<method>_ablation.json) and, with the
tables' text, to <root>/ablation.json, and prints the tables. `--from FILE` prints the tables from
a results file and trains nothing: that output is what the method's page in docs/ shows, verbatim
(tests/unit/test_docs_tables.py checks it). Nothing here imports torch or vldist.

The results file (schema "vldist-ablation/1"; no absolute paths, no host names):

    {"schema": "vldist-ablation/1",
     "method": "vsrn",
     "command": "python bench/vsrn_ablation.py --seeds 0 1 2",   # the options that change results
     "options": {"steps": null, "shards": null},                # the bench's own options
     "common_overrides": ["eval.baseline=false", ...],           # every run's, besides seed=<k>
     "seeds": [0, 1, 2],
     "rows": {"<row key>": {"label": "Mean-pool", "job": "vsrn", "overrides": ["model.rrr_layers=0", ...],
                            "runs": {"0": {"metrics": {"rsum": 410.9, ...}, "seconds": 301.5,
                                           "commit": "76ab57c", "torch": "2.14.1", "precision": "no"}, ...}},
              ...}}

A run's "metrics" are the bench's named numbers from its metrics.json (the bench's METRICS; a
number the run did not report, or NaN, is left out); "seconds" is the training process's wall
time, "commit" `git describe --always --dirty` when it started and "torch" the installed torch's
version (null for a run trained before the bench recorded them, in <run>/bench_run.json): the same
commit on another torch version trains to other last digits, enough to move a 3-seed mean.
"precision" is the metrics.json's: what `engine.mixed_precision` ran as ("no" is fp32; a job's
`auto` is bf16 on a CPU with AMX or AVX512-BF16), null for a run from before vldist recorded it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import shlex
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "vldist-ablation/1"
NO_PAPER = "–"  # a row the paper does not have
RUN_RECORD = "bench_run.json"  # seconds and commit of a run, beside its outputs


@dataclass(frozen=True)
class Row:
    """One row of an ablation: its key (the run directory, --rows), its label in the tables, the
    job it trains and the overrides that make it."""

    key: str
    label: str
    job: str
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Col:
    """A table column: the named metric, its heading, its digits, and a factor (L2C: x 100)."""

    metric: str
    head: str
    digits: int = 1
    scale: float = 1.0


@dataclass(frozen=True)
class Run:
    metrics: dict  # the job's metrics.json
    seconds: float | None  # the training process's wall time; None: unknown (trained before it was recorded)
    commit: str | None
    kept: bool  # finished before this invocation
    torch: str | None = None  # the torch version it trained with; None: unknown (trained before it was recorded)


def _commit(cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=cwd or REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def train_once(job: str, run_dir: Path, argv: list[str], results: str = "metrics.json", cwd: Path | None = None) -> Run:
    """`python -m vldist.train JOB ARGV output.dir=RUN_DIR` in a fresh process, its output in
    run_dir/train.log, unless run_dir/`results` is there from an earlier invocation (kept: an
    interrupted bench resumes, a rerun trains nothing). `results`: where the job writes its
    metrics under run_dir (a staged job: in its stage's directory, e.g. cl/metrics.json). `cwd`:
    run in that checkout instead (its vldist: `python -m` imports the working directory's)."""
    record = run_dir / RUN_RECORD
    kept = (run_dir / results).exists()
    if not kept:
        run_dir.mkdir(parents=True, exist_ok=True)
        commit = _commit(cwd)
        start = time.perf_counter()
        with open(run_dir / "train.log", "w") as log:
            done = subprocess.run(
                [sys.executable, "-m", "vldist.train", job, *argv, f"output.dir={run_dir}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
            )
        if done.returncode != 0:
            sys.exit(f"{run_dir}: training failed (exit {done.returncode}), see {run_dir / 'train.log'}")
        seconds = round(time.perf_counter() - start, 1)
        record.write_text(json.dumps({"seconds": seconds, "commit": commit, "torch": _torch_version()}) + "\n")
    info = json.loads(record.read_text()) if record.exists() else {}
    return Run(
        json.loads((run_dir / results).read_text()), info.get("seconds"), info.get("commit"), kept, info.get("torch")
    )


def _torch_version() -> str | None:
    """The installed torch's version, read from its metadata (the bench itself never imports torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def pick(metrics: dict, paths: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """The named numbers of a metrics.json: {name: metrics[p0][p1]...} for each name's path; a
    path the run lacks, or a NaN (a METEOR that timed out), is left out; floats to 6 decimals."""
    out = {}
    for name, path in paths.items():
        value = metrics
        for part in path:
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name] = round(value, 6) if isinstance(value, float) else value  # no float noise in the file
    return out


# ---------------------------------------------------------------- tables


def mean_std(values: list[float], digits: int = 1) -> str:
    """'m ± s' with the sample std; just 'm' for one value."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def md(text: str) -> str:
    """Text for a markdown table cell: * and | escaped."""
    return text.replace("*", "\\*").replace("|", "\\|")


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header line, its rule, then one line per row of cells."""
    lines = [head, *rows]
    text = ["| " + " | ".join(cells) + " |" for cells in lines]
    text.insert(1, "|" + "---|" * len(head))
    return "\n".join(text)


def seed_metrics(data: dict, key: str) -> list[dict]:
    """Row `key`'s metrics, one dict per seed of data["seeds"], in that order."""
    runs = data["rows"][key]["runs"]
    missing = [s for s in data["seeds"] if str(s) not in runs]
    if missing:
        raise ValueError(f"row {key!r} has no run for seed(s) {missing}")
    return [runs[str(s)]["metrics"] for s in data["seeds"]]


def column_values(runs: list[dict], col: Col) -> list[float] | None:
    """The column's value in each run (scaled); None when a run lacks it (the cell says n/a)."""
    if not runs or any(col.metric not in m for m in runs):
        return None
    return [col.scale * m[col.metric] for m in runs]


def paper_cell(value, digits: int) -> str:
    if value is None:
        return NO_PAPER
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def paper_columns(cols: Iterable[Col], prefix: str = "paper ") -> list[Col]:
    """The paper's counterpart of each column, headed `prefix` + its heading."""
    return [Col(c.metric, prefix + c.head, c.digits) for c in cols]


def paper_sum(values: Iterable[str], digits: int = 1) -> str:
    """A sum of numbers as the paper prints them (e.g. rsum, the sum of six recalls)."""
    return f"{sum(float(v) for v in values):.{digits}f}"


def ablation_table(
    data: dict,
    rows: list[Row],
    columns: list[Col],
    per_seed: Col | None = None,
    paper: dict[str, dict] | None = None,
    paper_cols: list[Col] = (),
    first: str = "row",
) -> str:
    """A markdown table of the rows of `rows` that `data` holds (a results file), in that order:
    each column's mean ± sample std over data["seeds"], then `per_seed`'s value in each seed,
    then the paper's columns (paper[row key][metric]: a string as the paper prints it, or a
    number; a row the paper lacks shows NO_PAPER). '' when data has none of the rows."""
    present = [row for row in rows if row.key in data["rows"]]
    if not present:
        return ""
    seeds = data["seeds"]
    head = [first, *(c.head for c in columns)]
    if per_seed is not None:
        head.append(f"{per_seed.head} per seed ({' / '.join(str(s) for s in seeds)})")
    head += [c.head for c in paper_cols]
    lines = []
    for row in present:
        runs = seed_metrics(data, row.key)
        cells = [md(row.label)]
        for col in columns:
            values = column_values(runs, col)
            cells.append("n/a" if values is None else mean_std(values, col.digits))
        if per_seed is not None:
            values = column_values(runs, per_seed)
            cells.append("n/a" if values is None else " / ".join(f"{v:.{per_seed.digits}f}" for v in values))
        for col in paper_cols:
            cells.append(paper_cell((paper or {}).get(row.key, {}).get(col.metric), col.digits))
        lines.append(cells)
    return markdown_table(head, lines)


def neighbours(rows: list[Row], data: dict) -> list[tuple[str, str]]:
    """Each row that `data` holds with the next one of them, in table order."""
    present = [row for row in rows if row.key in data["rows"]]
    return [(a.key, b.key) for a, b in pairwise(present)]


def spread_line(data: dict, rows: list[Row], col: Col, pairs: list[tuple[str, str]]) -> str:
    """For each pair of rows (A, B), whether B's mean of `col` is above A's (A < B) or below it
    (A > B) by more than the two rows' sample stds added, or within that (A ≈ B: no difference at
    these seeds): a line saying so, then one bullet per pair. Pairs with a row missing, or with
    fewer than two seeds, are left out; '' when none is left."""
    labels = {row.key: row.label for row in rows}
    d = col.digits
    bullets = []
    for a, b in pairs:
        if a not in data["rows"] or b not in data["rows"]:
            continue
        va, vb = column_values(seed_metrics(data, a), col), column_values(seed_metrics(data, b), col)
        if va is None or vb is None or len(va) < 2:
            continue
        diff = statistics.mean(vb) - statistics.mean(va)
        sa, sb = statistics.stdev(va), statistics.stdev(vb)
        op = ("<" if diff > 0 else ">") if abs(diff) > sa + sb else "≈"
        bullets.append(f"- {md(labels[a])} {op} {md(labels[b])} (Δ {diff:+.{d}f}, stds {sa:.{d}f} + {sb:.{d}f})")
    if not bullets:
        return ""
    head = (
        f"{col.head} over {len(data['seeds'])} seeds, row against row (A < B: B's mean is above A's by more "
        f"than the two sample stds added; A ≈ B: the difference is within them; Δ = B − A):"
    )
    return "\n".join([*textwrap.wrap(head, 100, break_long_words=False, break_on_hyphens=False), *bullets])


def blocks(*parts: str) -> str:
    """The non-empty parts, a blank line between them."""
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------- results files


def portable(value):
    """A path (or an override's path value) as the results file may hold it: relative to the
    repository, or <outside>/NAME for one outside it."""
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, Path) or (isinstance(value, str) and value.startswith("/")):
        path = Path(value)
        if not path.is_absolute():
            return str(path)
        try:
            return str(path.resolve().relative_to(REPO))
        except ValueError:
            return f"<outside>/{path.name}"
    if isinstance(value, str) and "=" in value:  # an override: key=value
        key, _, rest = value.partition("=")
        return f"{key}={portable(rest)}" if rest.startswith("/") else value
    return value


_NOT_RESULT_OPTIONS = {"help", "root", "results", "from_results", "update"}  # where, not what


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace, script: str) -> str:
    """`python bench/SCRIPT` with --seeds and every option that changes the results and is not at
    its default."""
    words = ["python", f"bench/{script}"]
    for action in parser._actions:
        if action.dest in _NOT_RESULT_OPTIONS or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if action.dest != "seeds" and value == action.default:
            continue
        values = portable(value if isinstance(value, list) else [value])
        words += [action.option_strings[-1], *(str(v) for v in values)]
    return shlex.join(words)


def bench_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The bench's own options (not seeds, rows, or where things go) and their values."""
    return {
        a.dest: portable(getattr(args, a.dest))
        for a in parser._actions
        if a.option_strings and a.dest not in _NOT_RESULT_OPTIONS | {"seeds", "rows"}
    }


class Recorder:
    """Collects each (row, seed)'s numbers as a bench trains, and prints a line per run."""

    def __init__(self, progress: list[Col]):
        self.progress = progress
        self.rows: dict[str, dict] = {}

    def __call__(self, row: Row, seed: int, run: Run, metrics: dict, overrides: list[str] | None = None) -> None:
        overrides = list(row.overrides if overrides is None else overrides)
        entry = self.rows.setdefault(
            row.key, {"label": row.label, "job": row.job, "overrides": portable(overrides), "runs": {}}
        )
        if entry["overrides"] != portable(overrides):
            raise ValueError(f"row {row.key!r}: overrides differ between seeds")
        entry["runs"][str(seed)] = {
            "metrics": metrics,
            "seconds": run.seconds,
            "commit": run.commit,
            "torch": run.torch,
            "precision": run.metrics.get("precision"),
        }
        took = "kept" if run.kept else f"{run.seconds:.0f} s"
        shown = ", ".join(
            f"{c.head} {c.scale * metrics[c.metric]:.{c.digits}f}" for c in self.progress if c.metric in metrics
        )
        print(f"{row.label}, seed {seed}: {shown} ({took})", flush=True)


def results_json(
    method: str, command: str, options: dict, common: list[str], seeds: list[int], rows: dict[str, dict]
) -> dict:
    """The results file's content (the schema above)."""
    for key, row in rows.items():
        missing = [s for s in seeds if str(s) not in row["runs"]]
        if missing:
            raise ValueError(f"row {key!r} has no run for seed(s) {missing}")
    return {
        "schema": SCHEMA,
        "method": method,
        "command": command,
        "options": options,
        "common_overrides": portable(list(common)),
        "seeds": list(seeds),
        "rows": rows,
    }


def load_results(path: Path, method: str) -> dict:
    """A results file, checked to be this bench's and of this schema."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        sys.exit(f"--from {path}: {err}")
    if data.get("schema") != SCHEMA:
        sys.exit(f"--from {path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    if data.get("method") != method:
        sys.exit(f"--from {path}: results of {data.get('method')!r}, not of {method!r}")
    return data


def ablation_parser(doc: str, method: str, row_keys: list[str] | None = None) -> argparse.ArgumentParser:
    """The options every ablation bench takes: --root (default runs/METHOD_ablation), --seeds,
    --results, --from, and --rows when the bench has named rows (default: all of them)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--root",
        type=Path,
        default=Path("runs") / f"{method}_ablation",
        help="where the runs go, each in <root>/<row>/seed<k> (default: %(default)s)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    if row_keys is not None:
        parser.add_argument("--rows", nargs="+", choices=row_keys, default=list(row_keys))
    default = REPO / "docs" / "results" / f"{method}_ablation.json"
    parser.add_argument(
        "--results",
        type=Path,
        default=default,
        help=f"where to write the per-seed results (default: docs/results/{default.name})",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the rows of the existing --results file that this invocation does not train, each "
        "with its own runs' commits (a kept row must have been trained with the row's overrides of now)",
    )
    parser.add_argument(
        "--from",
        dest="from_results",
        type=Path,
        metavar="RESULTS",
        help=f"print the tables from a results file (e.g. docs/results/{default.name}) and train nothing",
    )
    return parser


def updated_results(old: dict, new: dict, rows: list[Row]) -> dict:
    """`new` (this invocation's rows) with the rows of `old` it did not train, in the bench's row
    order; the commands of both kept. Exits with the reason when the two cannot be one table:
    other seeds or common overrides, or a kept row trained without an override its row has now."""
    options = set(old["options"]) | set(new["options"])  # an option added since: absent is its default, None
    differ = [k for k in options if old["options"].get(k) != new["options"].get(k)]
    differ += [k for k in ("seeds", "common_overrides") if old.get(k) != new[k]]
    if differ:
        sys.exit(f"--update: the results file's {differ} differ from this invocation's: rerun every row")
    stale = [
        row.key
        for row in rows
        if row.key not in new["rows"]
        and row.key in old["rows"]
        and not set(portable(row.overrides)) <= set(old["rows"][row.key]["overrides"])
    ]
    if stale:
        sys.exit(f"--update: rows {stale} were trained with other overrides than they have now: add them to --rows")
    merged = {row.key: new["rows"].get(row.key) or old["rows"].get(row.key) for row in rows}
    earlier = [*old.get("earlier_commands", []), old["command"]]
    return {**new, "earlier_commands": earlier, "rows": {k: v for k, v in merged.items() if v is not None}}


def bench_main(
    doc: str,
    method: str,
    script: str,
    rows: list[Row],
    progress: list[Col],
    train: Callable[[argparse.Namespace, Path, Recorder], list[str]],
    tables: Callable[[dict], str],
    options: Callable[[argparse.ArgumentParser], None] | None = None,
    row_keys: list[str] | None = None,
) -> None:
    """A bench's command line. `train(args, root, record)` trains (or keeps) every run, calls
    record(row, seed, run, metrics[, overrides]) for each, and returns the overrides common to
    all runs; `tables(results)` makes the tables' text from a results file's content. --from
    skips training and prints tables(the file)."""
    parser = ablation_parser(doc, method, [row.key for row in rows] if row_keys is None else row_keys)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    if args.from_results is not None:
        print(tables(load_results(args.from_results, method)))
        return
    root = args.root.resolve()
    record = Recorder(progress)
    common = train(args, root, record)
    data = results_json(
        method,
        command_line(parser, args, script),
        bench_options(parser, args),
        common,
        args.seeds,
        {row.key: record.rows[row.key] for row in rows if row.key in record.rows},
    )
    if args.update and args.results.exists():
        data = updated_results(load_results(args.results, method), data, rows)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    text = tables(data)
    root.mkdir(parents=True, exist_ok=True)
    (root / "ablation.json").write_text(json.dumps({"tables": text, **data}, indent=2, ensure_ascii=False) + "\n")
    print("\n" + text + "\n")
    print(f"results: {args.results}\nwith the tables: {root / 'ablation.json'}")
