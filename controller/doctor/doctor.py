"""`esd-sweep doctor`: can this machine (or cluster) run a sweep? One line per check.

Owns the command (which checks apply, in what order, lines as they finish or --json at the
end, the exit rule of controller.doctor.checks: 1 when a check that applies failed, else 0) and
the checks every backend shares:

- store: --output-dir checked, and a probe object (PROBE_KEY, top level) written, read back
  and deleted; a local folder that does not exist yet is not created;
- hf-token: HF_TOKEN asked about once (GET {HF_ENDPOINT}/api/whoami-v2), never shown.

This machine's GPUs and a worker on them are controller.doctor.local's checks; the
cluster's (--backend kubernetes) controller.doctor.kubernetes's, imported only
then (the kubernetes client is an extra). Apart from the probe object, nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

from controller.doctor.checks import FAIL, PASS, SKIP, Check, exit_status, report_json
from controller.doctor.local import WORKER_TIMEOUT_S, check_gpus, check_worker
from controller.errors import SweepError
from controller.gpu.gpus import GPU_INDEX, GPU_MEM_THRESHOLD_MIB, GpuSettings
from esd_worker.core.command.flags import HOUR_S, add_flag, float_in
from esd_worker.core.command.settings import DEVICES
from esd_worker.core.errors import WorkerError
from esd_worker.core.redact import redact
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import LocalStore

# Top level (no folder left behind once deleted), named for what wrote it and where from.
PROBE_KEY = "_doctor-probe-{host}-{pid}"
HUB_TIMEOUT_S = 10.0
DEFAULT_ENDPOINT = "https://huggingface.co"
TOKEN_URL = "https://huggingface.co/settings/tokens"
_TRUE = ("1", "true", "yes", "on")


# -- the command ---------------------------------------------------------------------------


def add_doctor_flags(p: argparse.ArgumentParser) -> None:
    """What `doctor` checks against (the device and GPU rule a sweep would use, its store,
    the backend) and how it reports; controller.cli adds `run`'s kubernetes flags."""
    add_flag(p, "--device", choices=DEVICES, default="auto",
             help="auto: GPUs when NVML sees any (none is not a failure); cuda: GPUs "
             "required; cpu: no GPU needed")
    add_flag(p, "--gpu-mem-threshold", "--gpu-memory-threshold", type=GPU_MEM_THRESHOLD_MIB,
             default=500.0,
             metavar="MIB", help="a GPU is free while its used memory is under this "
             "(MiB, default 500)")
    add_flag(p, "--gpu-list", "--gpus", type=GPU_INDEX, nargs="+", metavar="ID",
             help="the GPUs a sweep would use (default: all in the allocation)")
    add_flag(p, "--output-dir", "--output", metavar="URL",
             help="check that this result store is writable (default: not checked)")
    add_flag(p, "--backend", choices=("local", "kubernetes"), default="local",
             help="kubernetes: also check the API, RBAC, GPU nodes and the telemetry")
    add_flag(p, "--worker-timeout", type=float_in(0, HOUR_S, above=True, unit="seconds"),
             default=WORKER_TIMEOUT_S, metavar="S",
             help=f"seconds the worker's self-check may take (default {WORKER_TIMEOUT_S:g})")
    add_flag(p, "--json", action="store_true",
             help="print the checks as one JSON document (ok, exit_code, checks: name, "
             "status, detail, fix) instead of lines")


def run_doctor(args: argparse.Namespace) -> int:
    """`esd-sweep doctor`: every check that applies, one line each on stdout; the exit rule."""
    return diagnose(args, sys.stdout)


def diagnose(
    args: argparse.Namespace, out: IO[str], *, nvml_module: Any | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The checks for the parsed flags, printed to `out` as they finish (all at once with
    --json). nvml_module: pynvml or a fake (tests); environ: default os.environ."""
    env = os.environ if environ is None else environ
    gpu = gpu_settings(args)
    json_out = getattr(args, "json", False)
    checks: list[Check] = []
    for check in _checks(args, gpu, env, nvml_module):
        checks.append(check)
        if not json_out:
            print(check.line(), file=out, flush=True)
    if json_out:
        print(report_json(checks), file=out, flush=True)
    return exit_status(checks)


def gpu_settings(args: argparse.Namespace) -> GpuSettings:
    """The GPU rule of the flags; bad values are a usage error (exit 2), not a failed check."""
    gpu = GpuSettings(threshold_mib=args.gpu_mem_threshold,
                      gpu_list=tuple(args.gpu_list) if args.gpu_list else None)
    try:
        gpu.validate()
    except ValueError as e:
        raise SweepError(str(e)) from e
    if args.worker_timeout <= 0:
        raise SweepError(f"--worker-timeout: must be > 0 s, got {args.worker_timeout}")
    return gpu


def _checks(args: argparse.Namespace, gpu: GpuSettings, env: Mapping[str, str],
            nvml_module: Any | None) -> Iterator[Check]:
    kube = args.backend == "kubernetes"
    if kube:
        from controller.doctor.kubernetes import cluster_settings, kube_checks

        cluster = cluster_settings(args)  # bad flags: exit 2 before any check
        yield Check("gpus", SKIP, "not this machine's: with --backend kubernetes the sweep "
                    "uses the cluster's GPUs (see kube-nodes)")
        yield Check("worker", SKIP, f"not started here: workers run in pods of "
                    f"{cluster.image}; to check a GPU node, run `esd-worker --self-check "
                    "--device cuda` in a pod of that image")
    else:
        gpus, view = check_gpus(args.device, gpu, environ=env, module=nvml_module)
        yield gpus
        yield check_worker(args.device, view, timeout_s=args.worker_timeout)
    yield check_store(args.output_dir)
    yield check_hf_token(env)
    if kube:
        yield from kube_checks(cluster, device=args.device)


# -- store ---------------------------------------------------------------------------------


def check_store(url: str | None) -> Check:
    """The store opens, passes its own check, and takes a probe object (written, read back,
    deleted). A local folder that does not exist yet is not created."""
    if not url:
        return Check("store", SKIP, "not checked: give --output-dir URL to check that the "
                     "sweep can write its results there")
    shown = redact(url)
    try:
        store = open_store(url)
        store.check()
        if isinstance(store, LocalStore) and not store.root.exists():
            parent = next(p for p in store.root.parents if p.exists())
            return Check("store", PASS, f"{shown} does not exist yet; {parent} is writable "
                         "and the sweep creates it")
        key = PROBE_KEY.format(host=socket.gethostname(), pid=os.getpid())
        data = b"esd-sweep doctor: this object is deleted right after it is written\n"
        store.put_bytes(key, data)
        try:
            if store.get_bytes(key) != data:
                return Check("store", FAIL, f"{shown}: the probe object {key} read back "
                             "different bytes", "check the storage service (S3-compatible "
                             "endpoints: AWS_ENDPOINT_URL) before running a sweep")
        finally:
            store.delete(key)
    except WorkerError as e:
        return Check("store", FAIL, f"{shown}: {e}", _store_fix(url))
    return Check("store", PASS, f"{shown} is writable (probe object {key} written, read back "
                 "and deleted)")


def _store_fix(url: str) -> str:
    if url.startswith("s3://"):
        return ("check the bucket and prefix, the AWS credentials (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, IRSA) and, for S3-compatible "
                "storage, AWS_ENDPOINT_URL")
    return "pick a folder you can write to (--output-dir), or fix its permissions"


# -- HF token ------------------------------------------------------------------------------

Opener = Callable[..., Any]


def check_hf_token(environ: Mapping[str, str], *, timeout_s: float = HUB_TIMEOUT_S,
                   opener: Opener = urllib.request.urlopen) -> Check:
    """HF_TOKEN (or HUGGING_FACE_HUB_TOKEN) asked about once: GET {HF_ENDPOINT}/api/whoami-v2.
    Skipped without a token and when HF_HUB_OFFLINE is on. The token is never shown."""
    name = next((n for n in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
                 if environ.get(n, "").strip()), None)
    if name is None:
        return Check("hf-token", SKIP, "no HF_TOKEN set: public models only (gated or "
                     f"private ones need a token: {TOKEN_URL}, then export HF_TOKEN)")
    if environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return Check("hf-token", SKIP, f"{name} is set but not checked: HF_HUB_OFFLINE is on "
                     "(the sweep reads only the local cache)")
    token = environ[name].strip()
    endpoint = (environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    request = urllib.request.Request(
        f"{endpoint}/api/whoami-v2",
        headers={"Authorization": f"Bearer {token}", "User-Agent": "esd-sweep doctor"})
    try:
        with opener(request, timeout=timeout_s) as response:
            body = json.loads(response.read(1 << 20) or b"{}")
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return Check("hf-token", FAIL, f"{name} is not valid: the hub at {endpoint} "
                         "answered 401 Unauthorized", f"create a token at {TOKEN_URL} and "
                         f"export {name}=<the token> (or unset it for public models)")
        return Check("hf-token", FAIL, f"the hub at {endpoint} answered {e.code} "
                     f"{e.reason} to whoami", "try again later; the sweep would retry")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return Check("hf-token", FAIL, f"cannot reach the hub at {endpoint}: {reason}",
                     "check the network and proxy (HTTPS_PROXY), or set HF_HUB_OFFLINE=1 "
                     "to run from the local cache")
    return Check("hf-token", PASS, f"{name} is valid: {_whoami(body)} ({endpoint})")


def _whoami(body: Any) -> str:
    """`user NAME, token "DISPLAY" (role)` from a whoami-v2 answer, as far as it says."""
    if not isinstance(body, dict):
        return "the hub accepted it"
    text = f"{body.get('type') or 'user'} {body.get('name') or '?'}"
    token = ((body.get("auth") or {}).get("accessToken") or {})
    if isinstance(token, dict) and (token.get("displayName") or token.get("role")):
        text += f", token {token.get('displayName') or ''!r} ({token.get('role') or '?'})"
    return text
