"""``acc-train data prepare``: tokenize a job's data into the cache without launching workers."""

from __future__ import annotations

import json
from typing import Any

import click

from acc_train_cli.errors import report_plugin_failures, user_errors
from acc_train_cli.job import merge_parent_params, resolve_job

__all__ = ["data_group"]


@click.group("data")
def data_group() -> None:
    """Prepare a job's training data."""


@data_group.command("prepare")
@click.option("--config", "config_file", metavar="FILE", help="YAML job config (defaults < file < flags < --set).")
@click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE", help="Set any config key (repeatable), e.g. data.seq_len=2048.")
@click.option("--json", "as_json", is_flag=True, help="Print what was prepared as JSON.")
@click.pass_context
@user_errors
def prepare(ctx: click.Context, as_json: bool, **params: Any) -> None:
    """Tokenize the job's data files into the cache (data.cache_dir) once, here, with progress
    bars; every later launch, restart and resume on this machine reads it from there. Run it once
    per machine (or once, on a cache directory the machines share)."""
    job = resolve_job(merge_parent_params(ctx, params))
    report_plugin_failures()
    from acc_train.api import packs_rows
    from acc_train.data import check_data_files, prepare_data
    from acc_train.errors import UserError
    from acc_train.model.build import check_model_builds, check_model_path, load_tokenizer

    cfg = job.config
    if not cfg.data.train_files:
        raise UserError("the job has no data files (the demo corpus is made in memory at launch)", where="data.train_files", hint="set data.train_files")
    if cfg.data.streaming:
        raise UserError("a streamed job tokenizes its data as it trains; there is nothing to prepare", where="data.streaming", hint="set data.streaming=false to prepare a cache")
    check_model_path(cfg.model)
    check_data_files(cfg.data)
    check_model_builds(cfg, packs=packs_rows(cfg.data))
    prepared = prepare_data(cfg.data, load_tokenizer(cfg.model))
    summary = prepared.summary()
    if as_json:
        click.echo(json.dumps({**summary, "eval": prepared.eval_counts or None}, indent=2))
        return
    c = prepared.counts
    packing = {True: "on (next fit)", False: "off", "best_fit": "best fit"}.get(prepared.packing, str(prepared.packing))
    efficiency = prepared.packing_efficiency()
    filled = "" if efficiency is None else f"; rows {efficiency:.1%} full (packing efficiency: real tokens over row tokens)"
    click.echo(
        f"{'built' if prepared.cache == 'built' else 'already prepared'}: {prepared.path}\n"
        f"  kind {prepared.kind}, packing {packing}; {c['documents']} examples, {c['tokens']} tokens "
        f"({c['loss_tokens']} in the loss) in {c['rows']} rows of {cfg.data.seq_len}; truncated {c['truncated']}, dropped {c['dropped']}, empty {c['empty']}{filled}"
    )
