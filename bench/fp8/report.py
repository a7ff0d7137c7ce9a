#!/usr/bin/env python3
"""Compares the runs of the FP8 convergence study (bench/fp8/convergence.sh) with a baseline run.

Usage: report.py RUNS_DIR --baseline NAME --out DIR [--tolerance 0.01]

Every sub-folder of RUNS_DIR holding a metrics.jsonl is one run, named after the folder. Writes DIR/report.md
(one table row per run, the verdict, and the charts that `forge report --baseline NAME --svg-dir DIR/charts`
draws: convergence.sh runs both) and prints the table. Exit status: 0 when every run
has a final held-out loss within the tolerance of the baseline's, 1 when one does not or has no final
record, 2 on usage errors. Standard library only: the machines this runs on have no numpy or matplotlib.
"""

import argparse
import json
import math
import pathlib
import statistics
import sys
from dataclasses import dataclass, field

try:
    import tomllib  # Python 3.11+: only used to describe the model and each run's settings
except ImportError:
    tomllib = None

EMA_ALPHA = 0.1  # smoothing of the training loss (it is logged every log.every steps)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class UsageError(Exception):
    """A bad command line or RUNS_DIR: reported in one line with exit status 2."""


@dataclass
class Run:
    name: str
    directory: pathlib.Path
    train: list = field(default_factory=list)  # training records, one per step, by step
    evals: list = field(default_factory=list)  # held-out evaluations, one per step, by step
    final: dict | None = None  # the last record marked "final": the end-of-training evaluation
    skipped_lines: int = 0  # lines that were not JSON objects (e.g. cut off by a crash)
    ema: list = field(default_factory=list)  # smoothed training loss, parallel to train

    @property
    def final_eval_loss(self):
        return number(self.final.get("eval_loss")) if self.final else None

    @property
    def last_step(self):
        steps = [r["step"] for r in self.train + self.evals]
        return max(steps) if steps else 0

    @property
    def final_train_loss(self):
        return self.ema[-1] if self.ema else None

    @property
    def mean_tokens_per_s(self):
        # The first logged interval includes one-time costs (allocation, caches): leave it out.
        records = self.train[1:] if len(self.train) > 1 else self.train
        speeds = [number(r.get("tokens_per_s")) for r in records]
        speeds = [s for s in speeds if s is not None]
        return statistics.fmean(speeds) if speeds else None


def number(value):
    """A finite float, or None (NaN is written as null by the JSON writer; strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def load_run(run_dir):
    """Reads one run's metrics.jsonl, keeping the last record of each step (a resumed run repeats steps)."""
    run = Run(run_dir.name, run_dir)
    train_by_step, evals_by_step = {}, {}
    with open(run_dir / "metrics.jsonl", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                run.skipped_lines += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                run.skipped_lines += 1
                continue
            # Training and evaluation records share step numbers: deduplicate each kind on its own.
            if "eval_loss" in record:
                evals_by_step[record["step"]] = record
                if record.get("final") is True:
                    run.final = record
            elif "loss" in record:
                train_by_step[record["step"]] = record
    run.train = [r for _, r in sorted(train_by_step.items()) if number(r.get("loss")) is not None]
    run.evals = [r for _, r in sorted(evals_by_step.items()) if number(r.get("eval_loss")) is not None]
    ema = None
    for record in run.train:
        loss = number(record["loss"])
        ema = loss if ema is None else EMA_ALPHA * loss + (1 - EMA_ALPHA) * ema
        run.ema.append(ema)
    return run


def load_runs(runs_dir, baseline):
    if not runs_dir.is_dir():
        raise UsageError(f"runs directory '{runs_dir}' does not exist")
    runs = [load_run(d) for d in sorted(runs_dir.iterdir()) if (d / "metrics.jsonl").is_file()]
    if not runs:
        raise UsageError(f"no runs in '{runs_dir}' (no sub-folder has a metrics.jsonl)")
    names = [r.name for r in runs]
    if baseline not in names:
        raise UsageError(f"baseline run '{baseline}' not found in '{runs_dir}' (runs: {', '.join(names)})")
    # Baseline first, the others by name.
    return sorted(runs, key=lambda r: (r.name != baseline, r.name))


def relative(value, reference):
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference


def describe_model(runs):
    """'llama-default: 6 layers, hidden 128, 2000 steps x 2048 tokens', from what the runs recorded."""
    parts = []
    config_toml = next((r.directory / "config.toml" for r in runs if (r.directory / "config.toml").is_file()), None)
    if config_toml and tomllib:
        try:
            config = tomllib.loads(config_toml.read_text(encoding="utf-8"))
            model_config = pathlib.Path(config.get("model", {}).get("config", ""))
            for candidate in (model_config, REPO_ROOT / model_config):
                if model_config.name and candidate.is_file():
                    hf = json.loads(candidate.read_text(encoding="utf-8"))
                    parts.append(f"{model_config.stem}, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}")
                    break
            else:
                if model_config.name:
                    parts.append(model_config.stem)
        except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError):
            pass  # the title is a courtesy: fall back to the step count alone
    steps = max(r.last_step for r in runs)
    tokens_per_step = next(
        (r.train[-1]["tokens"] // r.train[-1]["step"] for r in runs
         if r.train and isinstance(r.train[-1].get("tokens"), int) and r.train[-1]["step"] > 0), None)
    parts.append(f"{steps} steps" + (f" x {tokens_per_step} tokens" if tokens_per_step else ""))
    return ", ".join(parts)


# Keys that name where a run writes or whether it resumed, not what it trains.
IGNORED_SETTINGS = {"log.run_dir", "checkpoint.dir", "checkpoint.resume"}


def flat_config(run):
    """The run's config.toml (written by forge train) as {"section.key": value}; {} when unreadable."""
    path = run.directory / "config.toml"
    if not tomllib or not path.is_file():
        return {}
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, tomllib.TOMLDecodeError):
        return {}
    return {f"{section}.{key}": value for section, table in config.items() if isinstance(table, dict)
            for key, value in table.items()}


def settings_differences(runs):
    """For each run, 'key=value' for every setting that differs from the baseline's (runs[0])."""
    base = flat_config(runs[0])
    out = []
    for run in runs:
        mine = flat_config(run)
        if not mine or not base:
            out.append("?" if run is not runs[0] else "")
            continue
        diffs = [f"{k}={mine[k]}" for k in sorted(mine) if k not in IGNORED_SETTINGS and mine.get(k) != base.get(k)]
        out.append(", ".join(diffs))
    return out


# ---------------------------------------------------------------------------------------------- the chart

def table_rows(runs, tolerance):
    """The report's rows as strings, and the problems that make the study fail."""
    base = runs[0]
    base_final, base_speed = base.final_eval_loss, base.mean_tokens_per_s
    rows, problems = [], []
    settings = settings_differences(runs)
    for run, setting in zip(runs, settings):
        final = run.final_eval_loss
        difference = relative(final, base_final)
        speed = run.mean_tokens_per_s
        speed_ratio = speed / base_speed if speed is not None and base_speed else None
        if final is None:
            within = "no (no final record)"
            problems.append(f"run '{run.name}' has no final held-out evaluation (unfinished or crashed)")
        elif difference is None:
            within = "n/a"  # the baseline has none: reported once, below
        elif abs(difference) <= tolerance:
            within = "yes"
        else:
            within = "no"
            problems.append(f"run '{run.name}': final held-out loss {final:.4f} is {100 * difference:+.2f}% from "
                            f"'{base.name}' ({base_final:.4f}), beyond the ±{100 * tolerance:g}% tolerance")
        rows.append([
            run.name + (" (baseline)" if run is base else ""),
            str(run.last_step),
            f"{final:.4f}" if final is not None else "—",
            f"{100 * difference:+.2f}%" if difference is not None else "—",
            within,
            f"{run.final_train_loss:.4f}" if run.final_train_loss is not None else "—",
            f"{speed:,.0f}" if speed is not None else "—",
            f"{speed_ratio:.2f}x" if speed_ratio is not None else "—",
            setting or ("—" if run is not base else "(as configured)"),
        ])
    return rows, problems


HEADER = ["run", "steps", "final held-out loss", "vs baseline", "within tolerance", "final training loss (EMA)",
          "mean tokens/s", "tokens/s vs baseline", "settings that differ from the baseline"]


def markdown_table(rows):
    """A Markdown table padded to aligned columns, readable in a terminal as well."""
    widths = [max(len(row[i]) for row in [HEADER] + rows) for i in range(len(HEADER))]
    numeric = [False, True, True, True, False, True, True, True, False]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(HEADER), rule] + [line(r) for r in rows])


def render_markdown(runs, baseline, tolerance, setup, table, problems):
    evals = runs[0].evals
    every = evals[1]["step"] - evals[0]["step"] if len(evals) > 2 else None
    lines = [
        "# FP8 convergence: recipes vs BF16" if baseline == "bf16" else f"# FP8 convergence: runs vs {baseline}",
        "",
        f"Produced by `bench/fp8/convergence.sh` ({setup}; held-out evaluation"
        + (f" every {every} steps and" if every else "") + " at the end), "
        "summarized by `bench/fp8/report.py`. Each run trains `configs/default.toml` on the same data; the last "
        "column lists where a run's settings (its `config.toml`) differ from the baseline's.",
        "",
        f"Tolerance: the final held-out loss may differ from `{baseline}` by at most ±{100 * tolerance:g}% "
        "(relative). Training loss is the exponential moving average (α = "
        f"{EMA_ALPHA:g}) of the logged losses; tokens/s is the mean over the logged intervals after the first.",
        "",
        table,
        "",
    ]
    if problems:
        lines += ["**Failed:**", ""] + [f"- {p}" for p in problems] + [""]
    else:
        lines += [f"All runs are within ±{100 * tolerance:g}% of `{baseline}`.", ""]
    lines += [
        "The whole comparison, every curve of every run overlaid: [report.html](report.html) (`forge report`, "
        "docs/report.md).",
        "",
        "![training loss](charts/loss.svg)",
        "",
        "![held-out loss relative to the baseline](charts/eval_vs_baseline.svg)",
        "",
        "![training loss relative to the baseline](charts/loss_vs_baseline.svg)",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the main


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def main(argv):
    summary, _, details = __doc__.split("\n\n", 2)
    parser = Parser(prog="report.py", description=summary, epilog=details,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", metavar="RUNS_DIR", type=pathlib.Path, help="one sub-folder per run")
    parser.add_argument("--baseline", required=True, metavar="NAME", help="the run the others are compared with")
    parser.add_argument("--out", required=True, metavar="DIR", type=pathlib.Path,
                        help="where report.md goes (created if missing)")
    parser.add_argument("--tolerance", type=float, default=0.01, metavar="FRACTION",
                        help="largest allowed relative difference of the final held-out loss (default 0.01 = 1%%)")
    args = parser.parse_args(argv)
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        raise UsageError(f"--tolerance must be a non-negative number, got {args.tolerance}")

    runs = load_runs(args.runs_dir, args.baseline)
    for run in runs:
        if run.skipped_lines:
            print(f"report.py: note: {run.name}/metrics.jsonl: skipped {run.skipped_lines} unreadable line(s)",
                  file=sys.stderr)
    setup = describe_model(runs)
    rows, problems = table_rows(runs, args.tolerance)
    if runs[0].final_eval_loss is None:
        problems.append(f"the baseline '{args.baseline}' has no final held-out loss: nothing to compare with")
    table = markdown_table(rows)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(
        render_markdown(runs, args.baseline, args.tolerance, setup, table, problems), encoding="utf-8")

    print(table)
    for problem in problems:
        print(f"FAIL: {problem}")
    print(f"wrote {args.out / 'report.md'}")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as error:
        print(f"report.py: error: {error}", file=sys.stderr)
        sys.exit(2)
