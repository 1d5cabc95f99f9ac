"""``swarm-node``: the volunteer's command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from node.errors import NodeError


def default_cache_dir() -> Path:
    base = os.environ.get("SWARM_NODE_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swarm-node"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Serve a shard of a language model to a swarm."""


@main.group()
def shard() -> None:
    """Prepare shard files."""


@shard.command("extract")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="Whole-model GGUF file.")
@click.option("--layers", required=True, help="Half-open layer range START:END, e.g. 0:15.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where shards are written.")
def shard_extract(model_path: Path, layers: str, cache_dir: Path | None) -> None:
    """Write the partial GGUF holding layers START..END-1 of MODEL."""
    from node.shard import extract_shard, parse_layers, read_model_meta

    cache = cache_dir or default_cache_dir()
    try:
        meta = read_model_meta(model_path, cache)
        start, end = parse_layers(layers, meta.n_layers)
        files = extract_shard(model_path, start, end, cache)
    except NodeError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"model        {meta.name} ({meta.architecture}, {meta.n_layers} layers, width {meta.n_embd})")
    click.echo(f"fingerprint  {meta.fingerprint}")
    click.echo(f"shard        [{start}, {end}) -> {files.path} ({files.path.stat().st_size / 1e6:.1f} MB)")
    if files.embeddings_path:
        click.echo(f"embeddings   {files.embeddings_path}")


@shard.command("vocab")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path))
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None)
def shard_vocab(model_path: Path, cache_dir: Path | None) -> None:
    """Write the metadata-only GGUF a gateway tokenizes with."""
    from node.shard import extract_vocab

    try:
        path = extract_vocab(model_path, cache_dir or default_cache_dir())
    except NodeError as err:
        raise click.ClickException(str(err)) from err
    click.echo(str(path))


if __name__ == "__main__":
    sys.exit(main())
