#!/usr/bin/env python3
"""Compares the runs of the FP8 convergence study (bench/fp8/convergence.sh) with a baseline run.

Usage: report.py RUNS_DIR --baseline NAME --out DIR [--tolerance 0.01]

Every sub-folder of RUNS_DIR holding a metrics.jsonl is one run, named after the folder. Writes DIR/loss.svg
(training loss and held-out loss against the step, and the held-out loss of each run relative to the
baseline) and DIR/report.md (one table row per run), and prints the table. Exit status: 0 when every run
has a final held-out loss within the tolerance of the baseline's, 1 when one does not or has no final
record, 2 on usage errors. Standard library only: the machines this runs on have no numpy or matplotlib.
"""

import argparse
import json
import math
import pathlib
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

try:
    import tomllib  # Python 3.11+: only used to describe the model and each run's settings
except ImportError:
    tomllib = None

EMA_ALPHA = 0.1  # smoothing of the training loss (it is logged every log.every steps)
WARMUP_STEPS = 100  # steps whose steep early loss is left out of the chart's y range
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

COLOURS = ["#1b1b1b", "#d95f02", "#1f78b4", "#33a02c", "#e7298a", "#7570b3", "#a6761d", "#66a61e"]


def nice_ticks(low, high, count=6):
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def tick_label(value):
    return f"{value:g}" if abs(value) < 1e5 else f"{value:.3g}"


def quantile(values, q):
    """Linear-interpolated quantile of a non-empty list."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


class Panel:
    """A rectangle of the chart with linear step -> x and value -> y maps."""

    def __init__(self, left, top, width, height, x_range, y_range):
        self.left, self.top, self.width, self.height = left, top, width, height
        self.x_low, self.x_high = x_range
        self.y_low, self.y_high = y_range

    def x(self, step):
        return self.left + (step - self.x_low) / (self.x_high - self.x_low) * self.width

    def y(self, value):
        return self.top + (self.y_high - value) / (self.y_high - self.y_low) * self.height

    def points(self, steps, values):
        return " ".join(f"{self.x(s):.1f},{self.y(v):.1f}" for s, v in zip(steps, values))


def loss_y_range(runs):
    """From just below the lowest smoothed or held-out loss up to the 95th percentile of the smoothed losses
    after the first steps, so the initial loss (~ln vocab) does not squash the interesting part."""
    smoothed = [v for r in runs for v in r.ema]
    late = [v for r in runs for rec, v in zip(r.train, r.ema) if rec["step"] > WARMUP_STEPS] or smoothed
    evals = [number(e["eval_loss"]) for r in runs for e in r.evals]
    if not smoothed + evals:
        return 0.0, 1.0  # nothing logged yet: an empty frame
    low = min(smoothed + evals)
    high = quantile(late, 0.95) if late else max(evals)
    high = max(high, low)
    span = high - low or 1.0
    return low - 0.08 * span, high + 0.05 * span


def svg_axes(out, panel, x_ticks, y_ticks, y_format, show_x_labels):
    """Grid lines, the frame and tick labels of one panel."""
    for value in y_ticks:
        if panel.y_low <= value <= panel.y_high:
            y = panel.y(value)
            out.append(f'<line x1="{panel.left}" y1="{y:.1f}" x2="{panel.left + panel.width}" y2="{y:.1f}" '
                       'stroke="#e4e4e4"/>')
            out.append(f'<text x="{panel.left - 6}" y="{y + 4:.1f}" text-anchor="end">{y_format(value)}</text>')
    for step in x_ticks:
        x = panel.x(step)
        out.append(f'<line x1="{x:.1f}" y1="{panel.top}" x2="{x:.1f}" y2="{panel.top + panel.height}" '
                   'stroke="#e4e4e4"/>')
        if show_x_labels:
            out.append(f'<text x="{x:.1f}" y="{panel.top + panel.height + 16}" text-anchor="middle">'
                       f'{tick_label(step)}</text>')
    out.append(f'<rect x="{panel.left}" y="{panel.top}" width="{panel.width}" height="{panel.height}" '
               'fill="none" stroke="#888"/>')


def render_svg(runs, baseline, tolerance, title):
    width, height = 900, 560
    left, plot_width = 72, 610
    x_high = max(r.last_step for r in runs) or 1
    x_ticks = nice_ticks(0, x_high, 8)
    top = Panel(left, 50, plot_width, 300, (0, x_high), loss_y_range(runs))
    base_evals = {e["step"]: number(e["eval_loss"]) for e in runs[0].evals}

    # Held-out loss of each run relative to the baseline's at the same step, in percent.
    differences = {}
    for run in runs[1:]:
        pairs = [(e["step"], relative(number(e["eval_loss"]), base_evals.get(e["step"]))) for e in run.evals]
        differences[run.name] = [(s, 100 * d) for s, d in pairs if d is not None]
    largest = max([abs(d) for pairs in differences.values() for _, d in pairs] + [100 * tolerance, 0.1])
    bottom = Panel(left, 392, plot_width, 112, (0, x_high), (-1.15 * largest, 1.15 * largest))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           '<defs>',
           *(f'<clipPath id="clip-{i}"><rect x="{p.left}" y="{p.top}" width="{p.width}" height="{p.height}"/>'
             '</clipPath>' for i, p in enumerate((top, bottom))),
           '</defs>',
           f'<text x="{width / 2}" y="26" text-anchor="middle" font-size="15" font-weight="bold">'
           f'{escape(title)}</text>']

    # Top panel: faint raw training loss, its moving average, and the held-out evaluations.
    svg_axes(out, top, x_ticks, nice_ticks(top.y_low, top.y_high, 7), lambda v: f"{v:g}", True)
    out.append('<g clip-path="url(#clip-0)" fill="none" stroke-linejoin="round">')
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        steps = [r["step"] for r in run.train]
        if steps:
            raw = [number(r["loss"]) for r in run.train]
            out.append(f'<polyline points="{top.points(steps, raw)}" stroke="{colour}" stroke-width="0.7" '
                       'stroke-opacity="0.2"/>')
            out.append(f'<polyline points="{top.points(steps, run.ema)}" stroke="{colour}" stroke-width="1.6"/>')
        if run.evals:
            eval_steps = [e["step"] for e in run.evals]
            eval_losses = [number(e["eval_loss"]) for e in run.evals]
            out.append(f'<polyline points="{top.points(eval_steps, eval_losses)}" stroke="{colour}" '
                       'stroke-width="1" stroke-dasharray="4 3"/>')
            out.extend(f'<circle cx="{top.x(s):.1f}" cy="{top.y(v):.1f}" r="3" fill="{colour}"/>'
                       for s, v in zip(eval_steps, eval_losses))
    out.append('</g>')
    out.append(f'<text transform="translate(18 {top.top + top.height / 2}) rotate(-90)" text-anchor="middle" '
               'font-size="12">loss (nats/token)</text>')

    # Bottom panel: held-out loss relative to the baseline, with the tolerance band.
    band_top, band_bottom = bottom.y(100 * tolerance), bottom.y(-100 * tolerance)
    out.append(f'<rect x="{bottom.left}" y="{band_top:.1f}" width="{bottom.width}" '
               f'height="{band_bottom - band_top:.1f}" fill="#e3f2e1"/>')
    svg_axes(out, bottom, x_ticks, nice_ticks(bottom.y_low, bottom.y_high, 5), lambda v: f"{v:+g}%", True)
    out.append(f'<line x1="{bottom.left}" y1="{bottom.y(0):.1f}" x2="{bottom.left + bottom.width}" '
               f'y2="{bottom.y(0):.1f}" stroke="{COLOURS[0]}" stroke-dasharray="4 3"/>')
    out.append('<g clip-path="url(#clip-1)" fill="none">')
    for i, run in enumerate(runs[1:], start=1):
        pairs = differences[run.name]
        if not pairs:
            continue
        colour = COLOURS[i % len(COLOURS)]
        out.append(f'<polyline points="{bottom.points(*zip(*pairs))}" stroke="{colour}" stroke-width="1.4"/>')
        out.extend(f'<circle cx="{bottom.x(s):.1f}" cy="{bottom.y(d):.1f}" r="2.5" fill="{colour}"/>'
                   for s, d in pairs)
    out.append('</g>')
    out.append(f'<text transform="translate(18 {bottom.top + bottom.height / 2}) rotate(-90)" '
               f'text-anchor="middle" font-size="12">vs {escape(baseline)}</text>')
    out.append(f'<text x="{left + plot_width / 2}" y="{bottom.top + bottom.height + 38}" text-anchor="middle" '
               'font-size="12">optimizer step</text>')

    # Legend: one entry per run with its final held-out loss, then what the line styles mean.
    legend_x, y = left + plot_width + 18, 62
    base_final = runs[0].final_eval_loss
    out.append(f'<text x="{legend_x}" y="{y}" font-weight="bold">run: final held-out loss</text>')
    for i, run in enumerate(runs):
        y += 20
        colour = COLOURS[i % len(COLOURS)]
        final = run.final_eval_loss
        if final is None:
            detail = "no final record"
        elif i == 0:
            detail = f"{final:.4f} (baseline)"
        else:
            detail = f"{final:.4f} ({100 * relative(final, base_final):+.2f}%)" if base_final else f"{final:.4f}"
        out.append(f'<line x1="{legend_x}" y1="{y - 4}" x2="{legend_x + 22}" y2="{y - 4}" stroke="{colour}" '
                   'stroke-width="2.5"/>')
        out.append(f'<text x="{legend_x + 28}" y="{y}">{escape(run.name)}: {escape(detail)}</text>')
    y += 34
    out.append(f'<line x1="{legend_x}" y1="{y - 4}" x2="{legend_x + 22}" y2="{y - 4}" stroke="#555" '
               'stroke-width="1.6"/>')
    out.append(f'<text x="{legend_x + 28}" y="{y}">training loss, EMA α={EMA_ALPHA:g}</text>')
    y += 18
    out.append(f'<line x1="{legend_x}" y1="{y - 4}" x2="{legend_x + 22}" y2="{y - 4}" stroke="#555" '
               'stroke-opacity="0.25"/>')
    out.append(f'<text x="{legend_x + 28}" y="{y}">training loss, raw</text>')
    y += 18
    out.append(f'<line x1="{legend_x}" y1="{y - 4}" x2="{legend_x + 22}" y2="{y - 4}" stroke="#555" '
               'stroke-dasharray="4 3"/>')
    out.append(f'<circle cx="{legend_x + 11}" cy="{y - 4}" r="3" fill="#555"/>')
    out.append(f'<text x="{legend_x + 28}" y="{y}">held-out loss</text>')
    out.append(f'<text x="{legend_x}" y="{bottom.top + 12}">held-out loss relative</text>')
    out.append(f'<text x="{legend_x}" y="{bottom.top + 26}">to {escape(baseline)}; green band:</text>')
    out.append(f'<text x="{legend_x}" y="{bottom.top + 40}">tolerance ±{100 * tolerance:g}%</text>')
    out.append('</svg>')
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------- the table


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
    lines += ["![loss curves](loss.svg)", ""]
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
                        help="where loss.svg and report.md go (created if missing)")
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
    baseline_name = "BF16" if args.baseline == "bf16" else args.baseline
    setup = describe_model(runs)
    title = f"FP8 recipes vs {baseline_name}: {setup}"
    rows, problems = table_rows(runs, args.tolerance)
    if runs[0].final_eval_loss is None:
        problems.append(f"the baseline '{args.baseline}' has no final held-out loss: nothing to compare with")
    table = markdown_table(rows)

    args.out.mkdir(parents=True, exist_ok=True)
    svg = render_svg(runs, args.baseline, args.tolerance, title)
    ElementTree.fromstring(svg)  # self-check: the chart must be well-formed XML
    (args.out / "loss.svg").write_text(svg, encoding="utf-8")
    (args.out / "report.md").write_text(
        render_markdown(runs, args.baseline, args.tolerance, setup, table, problems), encoding="utf-8")

    print(table)
    for problem in problems:
        print(f"FAIL: {problem}")
    print(f"wrote {args.out / 'report.md'} and {args.out / 'loss.svg'}")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as error:
        print(f"report.py: error: {error}", file=sys.stderr)
        sys.exit(2)
