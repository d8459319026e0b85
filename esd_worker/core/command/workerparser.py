"""The `esd-worker` command's flags: its one argparse definition (`build_parser`), torch-free.

Owns which flags the worker takes, their types, ranges, defaults and help. The command
(esd_worker.cli) parses with it and acts; the controller reads and writes worker command
lines with it (esd_worker.core.command.invocation), so the two can never disagree about a flag.
Does not own what a flag means once parsed (the worker's modules) or how a command line is
assembled (invocation).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from esd_worker import __version__
from esd_worker.core.command.flags import (
    HUB_RATE,
    MAX_RETRIES,
    MAX_ROWS,
    PREFETCH,
    PREFETCH_COUNT,
    Parser,
    add_analysis_flags,
    add_flag,
    add_host_eigensolvers_flag,
    add_model_timeout_flag,
    add_parallel_gpu_flags,
    int_in,
    size_in,
)
from esd_worker.core.command.settings import DEVICES
from esd_worker.core.logs import LOG_FORMATS

PROG = "esd-worker"
SHARD_INDEX_ENV = "JOB_COMPLETION_INDEX"  # Kubernetes sets it in every pod of an Indexed Job

EPILOG = f"""exit codes: 0 done (a batch: every model done or skipped); 2 usage (--shards: the
shard cannot run: no index, a bad index, no such shard); 3 permanent (a batch: some models
failed for good, each recorded in _failures/; --shards exits 0 then, the records being the
shard's outcome); 4 transient (network, storage, a stop; a batch: some failure a retry may
fix, after --max-retries more rounds; --shards exits 0 then, the retryable records being the
outcome); 5 out of GPU memory; 6 the device or its node is broken (nothing recorded against
any model: run it elsewhere); 128+N the batch's worker died of signal N with no model in
progress (a crash, hang or leak under a model costs that model's retries: a new worker goes
on). --self-check: 0 the spectrum matched float64 LAPACK, 6 the device
cannot be used (--device cuda without CUDA, a CUDA error), 3 wrong numbers. --shards
takes shard N of URL, URL/N.csv, N from --shard-index or {SHARD_INDEX_ENV}."""


def build_parser(parser_class: type[Parser] = Parser) -> argparse.ArgumentParser:
    """The esd-worker parser; parser_class: how it reports a refused command line (the
    command's one stderr line, or invocation's quiet exception)."""
    p = parser_class(
        prog=PROG,
        description="Analyse the weight spectra (ESD, power-law fits) of one model, or of many "
        "in one process, and write <model_key>/layers.csv, eigs.npz and result.json (last) "
        "to the output store.",
        epilog=EPILOG,
    )
    what = p.add_mutually_exclusive_group(required=True)
    add_flag(what, "--model", "--model-id", metavar="ID[@REV]|DIR",
             help="HF model id, optionally with @revision, or a local directory in HF layout")
    add_flag(what, "--models", metavar="CSV|URL",
             help="analyse every model of a model-list CSV (a path or s3:// URL) in this "
             "process; models already done are skipped, each outcome is recorded in the store")
    add_flag(what, "--shards", metavar="URL",
             help="analyse shard N of a sharded run: the model list URL/N.csv (URL a "
             "directory, file:// or s3:// folder), N from --shard-index or "
             f"${SHARD_INDEX_ENV}; as --models, skipping what failed for good in this --run-id")
    what.add_argument("--serve", action="store_true",
                      help="take models as JSON lines on stdin (the controller's protocol: "
                      "esd_worker/core/protocol.py) and answer one JSON line each on stdout")
    what.add_argument("--self-check", action="store_true",
                      help="no model: run a small Gram + eigvalsh on the device --device picks "
                      "(as the analysis does), compare it with float64 LAPACK and print one "
                      "JSON line (device, torch, CUDA, error); no --output needed")
    add_flag(p, "--base-model", "--source-model", metavar="ID[@REV]|DIR",
             help="base model of an adapter (default: base_model_name_or_path of "
             "adapter_config.json)")
    add_flag(p, "--relation", "--base-model-relation", default="",
             help="base_model_relation from the model list (adapter/lora/peft: the model "
             "must be an adapter)")
    # Required by every way of giving work but --self-check: checked in main, with
    # argparse's own wording.
    add_flag(p, "--output", "--output-dir", metavar="URL",
             help="result store: a directory, file:// or s3:// URL (required but with "
             "--self-check)")
    add_flag(p, "--model-key", default=None, help=argparse.SUPPRESS)  # set by the controller
    add_analysis_flags(p)
    add_flag(p, "--device", choices=DEVICES, default="auto",
             help="auto: CUDA when available, else CPU (default auto)")
    add_parallel_gpu_flags(p)
    add_host_eigensolvers_flag(p)
    add_flag(p, "--no-eigs", action="store_true", help="do not write eigs.npz")
    add_flag(p, "--trust-remote-code", action="store_true",
             help="allow model code from the hub to build the layer map (off by default)")
    add_flag(p, "--hub-rate", type=HUB_RATE, default=None, metavar="R",
             help="at most R hub requests a second from this process (model info, each file "
             "download), bursts of up to max(1, R); a 429 holds them all (default: no limit)")
    batch = p.add_argument_group("many models (--models, --shards, --serve)")
    add_flag(batch, "--shard-index", type=int_in(0, MAX_ROWS), default=None, metavar="N",
             help=f"with --shards: the shard to take (default ${SHARD_INDEX_ENV})")
    add_flag(batch, "--run-id", default="", help="stamped on the failure records written")
    add_flag(batch, "--max-retries", type=int_in(0, MAX_RETRIES), default=2,
             help="a model that killed more than this many workers (a crash, killed as hung "
             "or past --memory-limit) is recorded as a permanent failure (poison model) with "
             "the cause and not started again; --models, --shards: also the rounds a batch "
             "is run again after failures a retry may fix (default 2)")
    add_flag(batch, "--overwrite", action="store_true", help="analyse models that are done")
    add_flag(batch, "--skip-failed", action="store_true",
             help="skip models with a permanent failure record")
    add_flag(batch, "--prefetch", type=PREFETCH_COUNT, default=PREFETCH, metavar="N",
             help=f"models downloaded ahead while one is analysed (default {PREFETCH}; 0: "
             "none)")
    add_flag(batch, "--cache-budget", type=size_in(0), default=None, metavar="BYTES",
             help="disk for the model in progress and those ahead, e.g. 50G (default: half "
             "the free space where downloads go)")
    add_model_timeout_flag(batch)
    add_flag(batch, "--memory-limit", type=size_in(1), default=None, metavar="BYTES",
             help="with --shards, --models: the worker analysing a model is killed, and the "
             "model charged one attempt, when its resident memory passes this, e.g. 30G "
             "(default: 90%% of the container's memory limit; none outside a container)")
    add_flag(batch, "--cache-dir", type=Path, default=None, metavar="DIR",
             help="download into this directory, owned by the worker: a model's files are "
             "deleted once no later model needs them (default: the HF cache, never evicted)")
    add_flag(p, "--log-format", choices=LOG_FORMATS,
             default=os.environ.get("ESD_LOG_FORMAT", "text"),
             help="log lines for people (text) or clusters (json); env ESD_LOG_FORMAT")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return p
