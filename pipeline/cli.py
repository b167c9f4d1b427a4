"""The `ncl-pipeline` command line: run, submit, make-corpus, validate, status, inspect, report,
export, schemas.

Errors a user can fix (bad job file, missing shards, missing weights, a conflicting run
directory, an output another run is writing) and a failed run are printed as one `error:`
message, without a traceback; an interrupted run (SIGINT, SIGTERM) prints one sentence. The exit
status of each comes from one table, `pipeline.errors.EXIT_CODES` (0 ok, 1 run failed, 2 usage
or config error, 3 stopped by input.max_failed_shards, 130/143 interrupted), which `--help`
shows and docs/failures.md explains. Options that take a fixed set of values are typed as such,
so `--help` lists them and a typo is refused (exit 2) before anything runs.

The library logs through module loggers; every command shows them on the terminal through
`pipeline.runtime.console.setup_console` (set up in `_console`, before the command runs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import typer

from pipeline.errors import EXIT_CODES, ExitCode, RunInterrupted, UserError, exit_code


def _exit_codes_help() -> str:
    rows = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"Exit status (docs/failures.md):\n\n{rows}"


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Estimate soft correspondence labels for noisy image-text corpora (WebDataset shards).",
    epilog=_exit_codes_help(),
)

SET_HELP = "Override a job key, e.g. --set labels.method=rcr (repeatable)."
# The choices of fixed-set options; tests/test_cli.py checks they are the library's own.
ExportFormat = Literal["wds", "uid", "keys"]  # pipeline.stages.export.driver.FORMATS
NoiseModel = Literal["ncr", "web", "teacher"]  # pipeline.data.synthetic.NOISE_MODELS
LabelView = Literal["a", "b"]  # the co-teaching models whose labels a round holds
VIEW_HELP = (
    "For a round directory (RUN/rounds/<r>): the labels estimated from model A's embeddings "
    "(a) or model B's (b). Not needed for a run directory, whose published labels average both."
)


def _show_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        typer.echo(f"ncl-pipeline {version('ncl-pipeline')}")
    except PackageNotFoundError:
        _fail("ncl-pipeline is not installed as a package (pip install -e .): no version known")
    raise typer.Exit()


@app.callback()
def _console(
    show_version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_show_version,
        help="Print the installed version and exit.",
    ),
) -> None:
    # Runs before every command: the pipeline's log records to the terminal.
    from pipeline.runtime.console import setup_console

    setup_console()


def _fail(message: str, code: int = ExitCode.USAGE) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=int(code))


def _guard(function, *args, **kwargs):
    """Call `function`; turn the errors a user can fix, a failed run and an interrupt into a
    plain message and their exit status (`pipeline.errors.exit_code`)."""
    try:
        return function(*args, **kwargs)
    except UserError as exc:
        _fail(str(exc), exit_code(exc))
    except RunInterrupted as exc:  # Ctrl-C / SIGTERM: one sentence, exit 128 + the signal
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=exit_code(exc)) from None


@app.command()
def run(
    job_file: Path = typer.Argument(..., help="Job YAML, e.g. jobs/demo.yaml."),
    overrides: list[str] = typer.Option(None, "--set", help=SET_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show debug messages."),
    until: str = typer.Option(
        None,
        "--until",
        help="Stop once this stage is done (e.g. round0/embed, round1/train; "
        "`ncl-pipeline status` lists the stages).",
    ),
) -> None:
    """Run the pipeline for a job (local Ray by default, or ray.address / RAY_ADDRESS)."""
    from pipeline.config import load_job
    from pipeline.run.runner import run_job
    from pipeline.runtime.console import setup_console

    if verbose:
        setup_console(verbose=True)
    job = _guard(load_job, job_file, overrides)
    _guard(run_job, job, until=until)


@app.command()
def validate(
    job_file: Path = typer.Argument(..., help="Job YAML to check."),
    overrides: list[str] = typer.Option(None, "--set", help=SET_HELP),
    config_only: bool = typer.Option(
        False, "--config-only", help="Check the file only, not the shards or model weights."
    ),
) -> None:
    """Check a job file (and, unless --config-only, its shards, and whether the model's weights
    are cached here or will be downloaded at run time)."""
    from pipeline.config import load_job

    job = _guard(load_job, job_file, overrides)
    typer.echo(f"ok: job '{job.name}' is a valid configuration")
    if config_only:
        return
    from pipeline.models import check_weights_available
    from pipeline.run.runner import resolve_inputs
    from pipeline.run.specs import model_specs

    shards = _guard(resolve_inputs, job)
    typer.echo(f"ok: {len(shards)} input shards found")
    for spec in model_specs(job).values():
        weights = _guard(check_weights_available, spec)
        typer.echo(f"ok: model {job.model.name}: {weights.describe()}")
    from pipeline.run.specs import embeddings_source

    folder = _guard(embeddings_source, job)
    if folder is not None:
        pairs = sum(part.rows for part in folder.parts)
        typer.echo(
            f"ok: embeddings {folder.path}: {pairs:,} pairs in {len(folder.parts)} parts, "
            f"{folder.dim}-dimensional {folder.dtype}"
        )


def _web_knobs(noise_model: str, knobs: list[str] | None):
    """`--web NAME=VALUE` options as a WebNoise (None without any)."""
    import dataclasses

    from pipeline.data.synthetic import WebNoise

    if not knobs:
        return None
    if noise_model != "web":
        _fail("--web applies to --noise-model web only")
    fields = {f.name: f for f in dataclasses.fields(WebNoise)}
    values: dict = {}
    for knob in knobs:
        name, sep, text = knob.partition("=")
        if not sep or name not in fields:
            _fail(f"--web takes NAME=VALUE with NAME one of {', '.join(fields)}; got {knob!r}")
        default = getattr(WebNoise(), name)
        try:
            if isinstance(default, tuple) and all(isinstance(d, str) for d in default):
                values[name] = tuple(text.split(","))
            elif isinstance(default, tuple):
                values[name] = tuple(
                    type(d)(v) for d, v in zip(default, text.split(","), strict=True)
                )
            else:
                values[name] = type(default)(text)
        except ValueError:
            _fail(f"--web {name}: cannot read {text!r} as {type(default).__name__}")
    return WebNoise(**values)


@app.command("make-corpus")
def make_corpus_command(
    out: Path = typer.Option(..., "--out", help="Directory to write the shards into."),
    samples: int = typer.Option(4000, help="Training pairs."),
    noise: float = typer.Option(
        None, help="ncr only: fraction of mismatched pairs (caption of another). [default: 0.4]"
    ),
    partial: float = typer.Option(
        None, help="ncr only: fraction of partially matching pairs. [default: 0.1]"
    ),
    seed: int = typer.Option(0, help="Seed: the corpus is a pure function of the arguments."),
    samples_per_shard: int = typer.Option(500, help="Pairs per tar shard."),
    test_samples: int = typer.Option(500, help="Clean held-out pairs under OUT/test/."),
    val_samples: int = typer.Option(
        500, help="Clean validation pairs under OUT/val/ (select the warm-up; not reported)."
    ),
    image_size: int = typer.Option(64, help="Image side in pixels."),
    corrupt: float = typer.Option(0.0, help="Fraction of deliberately corrupt samples."),
    noise_model: NoiseModel = typer.Option(
        "ncr",
        "--noise-model",
        help="ncr (random swaps), web (pages, duplicates, page swaps, boilerplate, clutter) or "
        "teacher (clean; captions never name count or position). See docs/corpus.md.",
    ),
    web_knobs: list[str] = typer.Option(
        None,
        "--web",
        help="A web-model knob as NAME=VALUE, repeatable (e.g. --web page_swap=0.25); "
        "names as in pipeline.data.web_noise.WebNoise.",
    ),
    teacher_names: str = typer.Option(
        None,
        help="teacher only: the attributes its captions name, comma-separated, with the shape "
        "(e.g. shape,colour,size: blind to the background too). [default: all four]",
    ),
) -> None:
    """Write the synthetic noisy demo corpus in img2dataset layout, with ground truth."""
    from pipeline.data.synthetic import make_corpus

    web = _web_knobs(noise_model, web_knobs)
    try:
        summary = make_corpus(
            out,
            samples=samples,
            noise=noise,
            partial=partial,
            seed=seed,
            samples_per_shard=samples_per_shard,
            test_samples=test_samples,
            val_samples=val_samples,
            image_size=image_size,
            corrupt=corrupt,
            noise_model=noise_model,
            web=web,
            teacher_names=tuple(teacher_names.split(",")) if teacher_names else None,
        )
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(
        f"wrote {summary.samples} pairs in {len(summary.shards)} shards to {out} "
        f"({', '.join(f'{k}: {v}' for k, v in sorted(summary.counts.items()))}); "
        f"{len(summary.test_shards)} clean test shards in {out}/test, "
        f"{len(summary.val_shards)} clean validation shards in {out}/val"
    )
    if summary.noise_model != "ncr":
        counts = ", ".join(f"{k}: {v}" for k, v in summary.noise_type_counts.items() if v)
        typer.echo(f"noise model {summary.noise_model}; training pairs per noise type: {counts}")


@app.command()
def submit(
    job_file: Path = typer.Argument(..., help="Job YAML to run on the cluster."),
    address: str = typer.Option(
        None,
        "--address",
        envvar="RAY_API_SERVER_ADDRESS",
        help="Ray dashboard / Jobs API address, e.g. http://head:8265.",
    ),
    overrides: list[str] = typer.Option(None, "--set", help=SET_HELP),
    follow: bool = typer.Option(False, "--follow", help="Stream the job's logs until it ends."),
) -> None:
    """Submit a job to a Ray cluster through the Ray Jobs API."""
    from pipeline.run.submit import submit_job

    if not address:
        _fail("no cluster address: pass --address http://<head>:8265 (the Ray dashboard port)")
    status = _guard(submit_job, job_file, address, overrides, follow=follow)
    if follow and status != "SUCCEEDED":
        raise typer.Exit(code=int(ExitCode.RUN_FAILED))


@app.command()
def inspect(
    run_dir: str = typer.Argument(..., help="Run directory (the job's output)."),
    view: LabelView = typer.Option(None, help=VIEW_HELP),
) -> None:
    """Print counts per subset, label quantiles, mixture fits and the quarantine summary."""
    from pipeline.reporting.inspect import inspect_run

    typer.echo(_guard(inspect_run, run_dir, view=view))


@app.command()
def status(
    run_dir: str = typer.Argument(..., help="Run directory (the job's output)."),
    job_file: Path = typer.Option(
        None, "--job", help="Also say what a rerun of this job file would reuse and recompute."
    ),
    overrides: list[str] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Stages of a run (done / pending / stale, when, how long), what a rerun would reuse and
    recompute, and the quarantine count. Reads files only (no Ray)."""
    from pipeline.config import load_job
    from pipeline.run.status import run_status

    job = _guard(load_job, job_file, overrides) if job_file else None
    label = str(job_file) if job_file else ""
    typer.echo(_guard(run_status, run_dir, job, label=label))


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="Run directory (the job's output)."),
    view: LabelView = typer.Option(None, help=VIEW_HELP),
) -> None:
    """(Re)generate <run>/report/index.html: loss histogram with fits, label histograms, gallery."""
    from pipeline.reporting.report import write_report

    typer.echo(f"wrote {_guard(write_report, run_dir, view=view)}")


@app.command()
def audit(
    run_dir: str = typer.Argument(..., help="Run directory (the job's output) with labels/."),
    summary: bool = typer.Option(
        False, "--summary", help="Print what the answers so far estimate, instead of serving."
    ),
    per_decile: int = typer.Option(10, "--per-decile", help="Pairs to judge per label decile."),
    seed: int = typer.Option(0, help="Seed of the sample (and of the intervals' bootstrap)."),
    port: int = typer.Option(8377, help="Port on 127.0.0.1 (0: any free port)."),
    resample: bool = typer.Option(
        False, "--resample", help="Draw a new sample; the answers given so far are discarded."
    ),
    min_label: float = typer.Option(
        0.0, "--min-label", help="--summary: the export selection to judge (as export's)."
    ),
    subset: str = typer.Option("clean,quasi_clean", "--subset", help="--summary: as export's."),
) -> None:
    """Judge a sample of the labelled pairs in the browser (match / partial / mismatch), then
    estimate the precision of what the export keeps and drops, and the labels' AUROC."""
    from pipeline.reporting.audit import audit_summary, format_summary, serve_audit

    if summary:
        subsets = tuple(s.strip() for s in subset.split(",") if s.strip())
        found = _guard(audit_summary, run_dir, min_label, subsets, seed)
        typer.echo(format_summary(run_dir, found))
        return
    server = _guard(serve_audit, run_dir, port, per_decile, seed, resample)
    pairs = server.sample.table.num_rows
    typer.echo(
        f"audit: {server.url} ({pairs} pairs, {len(server.answers)} judged so far; keys 1 match, "
        f"2 partial, 3 mismatch, <- back). Answers are saved to {run_dir}/audit/answers.parquet "
        "as you give them; Ctrl-C stops, and rerunning resumes."
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    typer.echo(f"stopped; `ncl-pipeline audit {run_dir} --summary` prints the estimates")


@app.command()
def export(
    run_dir: str = typer.Argument(..., help="Run directory (the job's output) with labels/."),
    out: str = typer.Option(..., "--out", help="Export directory (created; must be empty)."),
    format: ExportFormat = typer.Option(
        "wds",
        "--format",
        help="wds: webdataset tars of the kept pairs; uid: a DataComp subset file (uids.npy); "
        "keys: keys.parquet (key, shard, label, subset, uid).",
    ),
    min_label: float = typer.Option(0.0, "--min-label", help="Keep soft_label >= this."),
    subset: str = typer.Option(
        "clean,quasi_clean",
        "--subset",
        help="Keep these subsets, comma-separated, of clean, quasi_clean, noisy.",
    ),
    keep_fraction: float = typer.Option(
        None,
        "--keep-fraction",
        help="Keep the top fraction F of every labelled pair by --rank-by, exact to one pair "
        "(DataComp's rule; instead of --min-label and --subset).",
    ),
    rank_by: str = typer.Option(
        "soft_label",
        "--rank-by",
        help="With --keep-fraction: soft_label, clean_prob, cosine (the CLIP score), a "
        "method's score column, or fusion (the mean percentile rank of soft_label and cosine); "
        "ties go to the smaller key.",
    ),
    samples_per_shard: int = typer.Option(
        10_000, "--samples-per-shard", help="wds: pairs per output shard."
    ),
    repeat_by_label: float = typer.Option(
        None, "--repeat-by-label", help="uid: write each uid round(R*label) times (upsampling)."
    ),
    seed: int = typer.Option(0, help="uid: seed of --repeat-by-label's stochastic rounding."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous export."),
    shards: list[str] = typer.Option(
        None, "--shards", help="Input tars, when they moved since the run (brace pattern)."
    ),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: local Ray)."),
) -> None:
    """Export the kept pairs for training: webdataset shards, DataComp uid file, or key list."""
    from pipeline.stages.export.driver import ExportSpec, export_run, format_summary, run_model_name

    try:
        spec = ExportSpec(
            run=run_dir,
            out=out,
            format=format,
            min_label=min_label,
            subsets=tuple(s.strip() for s in subset.split(",") if s.strip()),
            samples_per_shard=samples_per_shard,
            repeat_by_label=repeat_by_label,
            seed=seed,
            overwrite=overwrite,
            shards=tuple(shards) if shards else None,
            keep_fraction=keep_fraction,
            rank_by=rank_by,
        )
    except ValueError as exc:
        _fail(str(exc))
    summary = _guard(export_run, spec, address=address)
    typer.echo(format_summary(summary, run_model_name(run_dir)))


@app.command(hidden=True)
def schemas(
    out: Path = typer.Option(Path("schemas"), help="Folder for the JSON exports."),
    config_doc: Path = typer.Option(
        Path("docs/config.md"), help="Where to write the job file reference (Markdown)."
    ),
) -> None:
    """Regenerate the JSON schemas under schemas/ and docs/config.md from the code."""
    from pipeline.schemas import write_config_reference, write_schemas

    for path in [*write_schemas(out), write_config_reference(config_doc)]:
        typer.echo(f"wrote {path}")


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app(prog_name="ncl-pipeline")


if __name__ == "__main__":
    main()
