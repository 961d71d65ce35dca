"""The no-GPU toolkit on the command line: ``serve-reference`` and ``demo``."""

from __future__ import annotations

from pathlib import Path

import click

from hcapo_store import formatting
from hcapo_store.cli.main import Ctx, cli, echo_json
from hcapo_store.cli.params import Device, int_range
from hcapo_store.scoring import defaults


@cli.command("serve-reference")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Local transformers causal LM directory.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Tokenizer directory (default: the model directory).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=int_range(0, 65535), default=30000, show_default=True, help="Port to listen on (SGLang's default)."
)
@click.option(
    "--context-length",
    type=int_range(2, 2**24),
    help="Context length to advertise and enforce (at most N-1 input tokens, as SGLang); default: the model's.",
)
@click.option(
    "--device",
    type=Device(),
    metavar="cuda|cuda:N|cpu",
    help="Where the model runs. Default: the GPU when there is one, else the CPU.",
)
@click.option(
    "--dtype",
    type=click.Choice(defaults.DTYPES),
    help="What the model computes in (reported in /model_info; part of the scorer that scores through it). "
    "Default: the checkpoint's own on a GPU, float32 on the CPU.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=defaults.CUDA_GRAPHS,
    show_default=True,
    help="On a GPU, replay each forward shape as a CUDA graph (the same values, checked against the eager forward).",
)
def serve_reference(
    model_dir: Path,
    tokenizer_dir: Path | None,
    host: str,
    port: int,
    context_length: int | None,
    device: str | None,
    dtype: str | None,
    cuda_graphs: bool,
) -> None:
    """Serve an SGLang-compatible /generate (and a vLLM /v1/completions subset) over a local model.

    Real logprobs from a transformers model (on the CPU or a GPU): for tests, the demo, and users
    without an inference server.
    """
    from hcapo_store.devkit.refserver import make_server

    server = make_server(
        model_dir,
        tokenizer_dir,
        host=host,
        port=port,
        context_length=context_length,
        device=device,
        dtype=dtype,
        cuda_graphs=cuda_graphs,
    )
    info = server.model_info()
    click.echo(f"serving {model_dir} ({info['dtype']} on {info['device']}) at {server.url} (Ctrl-C to stop)", err=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()


@cli.command()
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".hcapo-demo"),
    show_default=True,
    help="Where the demo model (and episodes, outside a checkout) are built.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_context
def demo(ctx: click.Context, workdir: Path, as_json: bool) -> None:
    """Run the main job end to end on a tiny local model: ingest, score, credits.

    Builds a tiny random model and tokenizer (no download, no GPU), ingests the example
    episodes, scores every step through the reference server over HTTP, computes the
    default credits, prints the scored steps and credits per subtask, and ends with
    diagnose's one-line verdict on the run. Uses --db if given, else DIR/demo.db.
    """
    from hcapo_store.devkit.demo import demo_summary, manual_commands, run_demo

    state: Ctx = ctx.obj
    if state.db is None:  # the demo's own folder: made here, as a missing --db folder is refused
        workdir.mkdir(parents=True, exist_ok=True)
        state.db = str(workdir / "demo.db")
    store = state.store()
    result = run_demo(
        store, workdir, on_step=(lambda _: None) if as_json else (lambda m: click.echo(f"• {m}", err=True))
    )
    commands = manual_commands(result, store.display)
    if as_json:
        echo_json({**demo_summary(result), "commands": commands})
        return
    click.echo(f"ingest: {result.ingest.summary()}")
    click.echo(f"score:  {result.score.summary()}")
    click.echo(f"\nscored steps per subtask (scorer {result.scorer_id[:12]}):")
    click.echo(formatting.table(*result.subtasks))
    if result.credits:
        click.echo("\ncredits per subtask (run 'default'):")
        click.echo(formatting.table(*result.credits))
    click.echo(
        f"\ndatabase: {store.display} — try: hcapo-store --db {store.display} sql "
        "\"SELECT subtask_id, avg(q_h_smoothed) FROM step_credits WHERE run = 'default' GROUP BY 1\""
    )
    click.echo(f"\ntiny model (weights and tokenizer): {result.model_dir}")
    click.echo("score by hand against it (two shells):")
    for command in commands:
        click.echo(f"  {command}")
    if result.verdict:  # the demo ends with the answer: is this hindsight signal usable?
        click.echo(f"\n{result.verdict} (run 'default'; the numbers: hcapo-store --db {store.display} diagnose)")
