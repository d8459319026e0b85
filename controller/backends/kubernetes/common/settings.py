"""How `--backend kubernetes` runs a sweep: its settings, their checks, and what a Job inherits.

Owns ClusterSettings (built in controller.cli from flags and env), the instance label value
that ties a sweep's Jobs to its output (the key is names.INSTANCE_LABEL), the environment
passed through to workers, and which worker flags do not change a result (for adoption: the
worker's command line is read as a value, esd_worker.core.command.invocation).
Pure: no Kubernetes client here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller import __version__
from controller.backends.kubernetes.common.jobs import GPU_RESOURCE, JobSettings
from controller.backends.kubernetes.common.resources import ResourceClass, disk_for, memory_for
from esd_worker.core.command.flags import (
    DAY_S,
    HOUR_S,
    HUB_RATE,
    PORT,
    WEEK_S,
    add_flag,
    float_in,
    int_in,
    size_in,
)
from esd_worker.core.command.invocation import InvalidInvocation, WorkerInvocation, parse_command

DEFAULT_NAMESPACE = "esd-sweep"
DEFAULT_SERVICE_ACCOUNT = "esd-sweep-worker"
DEFAULT_TELEMETRY_SELECTOR = "app.kubernetes.io/name=esd-gpu-exporter"
DEFAULT_TELEMETRY_PORT = 9400
AUTO = "auto"  # --memory-request / --ephemeral-storage-request: sized from the weights
PER_MODEL_DEADLINE_S = 6 * 3600  # --active-deadline of one-Job-per-model pods by default
MIN_TTL_S = 60  # the controller reads a finished Job's status before the TTL removes it
MAX_JOB_S = 30 * DAY_S  # --active-deadline, --ttl-after-finished: longer is a unit slip
MAX_JOBS = 10**5  # --max-active-jobs, --max-pending, --max-parallel (GPUs)


def default_image() -> str:
    """ESD_IMAGE from the environment is read by the CLI; this is the fallback tag."""
    return f"ghcr.io/esd-sweep/esd-sweep:{__version__}"


def sweep_instance(output_url: str) -> str:
    """The `app.kubernetes.io/instance` label of every Job writing to `output_url`.

    A pure function of the output, so every run of the same sweep (and a restarted
    controller) selects the same Jobs, and sweeps into other stores are left alone.
    """
    return "out-" + hashlib.sha256(output_url.encode("utf-8")).hexdigest()[:12]


@dataclass(frozen=True)
class ClusterSettings:
    """How `--backend kubernetes` runs a sweep (built in controller.cli from flags and env).

    namespace: where the Jobs go (default esd-sweep); kube_context: kubeconfig context
    (None: the current one, or the pod's service account in a cluster).
    image: the worker image (`esd-worker` on PATH). worker_template: a PodTemplate in
    `namespace` whose `worker` container's image replaces `image` once a client is open
    (common.wiring.with_template_image; the manifests' esd-sweep-worker, which kustomize's
    `images:` rewrites). node_selector, priority_class,
    service_account (default esd-sweep-worker), hf_token_secret (NAME:KEY), s3_secret,
    hf_cache_pvc, image_pull_secrets, tolerations ((key, value or None, effect) each),
    cpu_request: passed to each Job. gpu_resource: the extended resource worker pods
    request for a GPU (nvidia.com/gpu, or a MIG slice: nvidia.com/mig-1g.10gb); the one
    --max-parallel and the doctor count. memory_request / ephemeral_storage_request: Kubernetes
    quantities, or AUTO (the default): sized from the weights' bytes (common.resources
    .memory_for, disk_for) per model, or per resource class for shards.
    job_deadline_s: activeDeadlineSeconds of each worker pod, counted once it is on a node
    (None: 6 h for one Job per model, no limit for shard pods, which run many models).
    ttl_after_finished_s: how long a finished worker Job is kept (default 24 h).
    max_active_jobs: unfinished Jobs of this sweep at once (default 100).
    allow_pending: submit Jobs without pinning them to a node with room when none has
    any, so a cluster autoscaler / Karpenter adds nodes; max_pending: at most this many
    of them not running yet (None: no limit beyond max_active_jobs).
    do_not_disrupt: pods carry karpenter.sh/do-not-disrupt.
    kueue_queue: LocalQueue; Jobs are created suspended and Kueue admits them.
    telemetry_selector / telemetry_namespace (None: namespace) / telemetry_port: the GPU
    exporter pods scraped at http://<pod IP>:<port>/metrics; telemetry_urls: scrape these
    instead (out-of-cluster runs, tests); telemetry=False: no scraping at all.
    pending_timeout_s: a Job not running after this many seconds is diagnosed (why it is
    pending) in the log and the run report (default 600); in a sharded run, a class whose
    pods the scheduler has found no node for this long ends the run (exit 3).
    wait: wait until every Job has ended (default); False: submit what fits and return,
    leaving Jobs running (a later run adopts them).
    watch_timeout_s: server-side timeout of each watch request (the watch is reopened).
    log_tail_lines: lines of a failed pod's log kept in its failure record.
    backoff_limit: counted pod failures a Job absorbs (default 0: each counted failure
    ends the Job, and the controller decides on a retry, as a new Job `-a<N>`).
    shard_size: models per shard at most (0: auto, up to 1,000; 1: one Job per model, the
    per-model backend). max_parallel: the sharded run's GPU budget (pods at once, in GPUs;
    for CPU-only classes, pods). hub_rate: hub requests per second for the whole sweep,
    shared by its pods (and the controller's size lookups). large_model_bytes: models
    bigger than this go to the "gpu-large" class. poll_interval_s: seconds between looks
    at a sharded run's Jobs.
    """

    namespace: str = DEFAULT_NAMESPACE
    kube_context: str | None = None
    image: str = field(default_factory=default_image)
    worker_template: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    service_account: str | None = DEFAULT_SERVICE_ACCOUNT
    hf_token_secret: str | None = None
    s3_secret: str | None = None
    hf_cache_pvc: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    tolerations: tuple[tuple[str, str | None, str], ...] = ()
    cpu_request: str = "2"
    gpu_resource: str = GPU_RESOURCE
    memory_request: str = AUTO
    ephemeral_storage_request: str = AUTO
    job_deadline_s: int | None = None
    ttl_after_finished_s: int = 24 * 3600
    max_active_jobs: int = 100
    allow_pending: bool = False
    max_pending: int | None = None
    do_not_disrupt: bool = False
    kueue_queue: str | None = None
    telemetry: bool = True
    telemetry_selector: str = DEFAULT_TELEMETRY_SELECTOR
    telemetry_namespace: str | None = None
    telemetry_port: int = DEFAULT_TELEMETRY_PORT
    telemetry_urls: tuple[str, ...] = ()
    pending_timeout_s: float = 600.0
    wait: bool = True
    allow_local_output: bool = False
    watch_timeout_s: int = 60
    log_tail_lines: int = 20
    backoff_limit: int = 0
    shard_size: int = 0
    max_parallel: int = 100
    hub_rate: float = 3.0
    large_model_bytes: int = 30 * 10**9
    poll_interval_s: float = 10.0

    def problems(self) -> list[str]:
        """Every problem with these settings, each naming its flag (empty: usable)."""
        out: list[str] = []
        if self.max_active_jobs < 1:
            out.append(f"--max-active-jobs: must be >= 1, got {self.max_active_jobs}")
        if self.max_pending is not None and self.max_pending < 1:
            out.append(f"--max-pending: must be >= 1, got {self.max_pending}")
        if self.max_pending is not None and not self.allow_pending:
            out.append("--max-pending needs --allow-pending")
        if self.ttl_after_finished_s < MIN_TTL_S:
            out.append(f"--ttl-after-finished: must be >= {MIN_TTL_S} s (the controller "
                       f"reads a finished Job's status), got {self.ttl_after_finished_s}")
        if not self.pending_timeout_s > 0:
            out.append(f"--pending-timeout: must be > 0 s, got {self.pending_timeout_s}")
        if not 0 < self.telemetry_port < 65536:
            out.append(f"--telemetry-port: must be 1..65535, got {self.telemetry_port}")
        if self.watch_timeout_s < 1:
            out.append(f"watch_timeout_s: must be >= 1, got {self.watch_timeout_s}")
        if self.shard_size < 0:
            out.append(f"--shard-size: must be >= 0 (0: auto), got {self.shard_size}")
        if self.max_parallel < 1:
            out.append(f"--max-parallel: must be >= 1, got {self.max_parallel}")
        if not self.hub_rate > 0:
            out.append(f"--hub-rate: must be > 0 requests/s, got {self.hub_rate}")
        if self.large_model_bytes < 1:
            out.append(f"--large-model-size: must be > 0, got {self.large_model_bytes}")
        if not self.poll_interval_s > 0:
            out.append(f"poll_interval_s: must be > 0, got {self.poll_interval_s}")
        return out

    def job_settings(
        self, *, run_id: str, instance: str, gpus_per_job: int,
        worker: WorkerInvocation | None = None,
    ) -> JobSettings:
        """Every worker Job's settings, sized for one model of unknown size (sized_for and
        for_class size them for real); worker: what every worker of the run is given
        (None: the defaults, JSON logs)."""
        deadline = PER_MODEL_DEADLINE_S if self.job_deadline_s is None else self.job_deadline_s
        job = JobSettings(
            image=self.image, namespace=self.namespace, run_id=run_id, sweep_name=instance,
            gpus_per_job=gpus_per_job, gpu_resource=self.gpu_resource,
            cpu_request=self.cpu_request,
            backoff_limit=self.backoff_limit, active_deadline_s=deadline,
            ttl_after_finished_s=self.ttl_after_finished_s,
            node_selector=dict(self.node_selector), priority_class=self.priority_class,
            service_account=self.service_account, image_pull_secrets=self.image_pull_secrets,
            tolerations=self.tolerations, hf_token_secret=self.hf_token_secret,
            s3_secret=self.s3_secret, hf_cache_pvc=self.hf_cache_pvc,
            kueue_queue=self.kueue_queue, do_not_disrupt=self.do_not_disrupt,
            env=worker_passthrough_env(),
        )
        if worker is not None:
            job = replace(job, worker=worker)
        return self.sized_for(job, 0, copies=1)

    def sized_for(self, job: JobSettings, size: int, *, copies: int) -> JobSettings:
        """`job` asking for the memory and disk of a model of `size` weight bytes, with
        `copies` such models on disk at once (the flags' quantities when not AUTO)."""
        return self._with_requests(job, memory_for(size), disk_for(size, copies=copies))

    def for_class(self, job: JobSettings, cls: ResourceClass) -> JobSettings:
        """`job` for the pods of one resource class: its GPUs and its memory and disk (the
        flags' when not AUTO); a shard pod runs many models, so it has no deadline unless
        --active-deadline was given."""
        job = replace(job, gpus_per_job=cls.gpus, active_deadline_s=self.job_deadline_s)
        return self._with_requests(job, cls.memory, cls.ephemeral_storage)

    def _with_requests(self, job: JobSettings, memory: str, disk: str) -> JobSettings:
        """`job` with these sized memory and disk requests, each unless its flag gave a
        quantity."""
        return replace(
            job, memory_request=memory if self.memory_request == AUTO else self.memory_request,
            ephemeral_storage_request=(disk if self.ephemeral_storage_request == AUTO
                                       else self.ephemeral_storage_request))


# Non-secret settings the workers need to reach the same store and hub as the controller
# (an S3-compatible endpoint, its region, retry mode, a hub mirror). Credentials are not
# here: they reach the pods through --s3-secret / --hf-token-secret or IRSA.
PASSTHROUGH_ENV = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "HF_ENDPOINT",
)


def result_invocation(args: Sequence[str]) -> WorkerInvocation | None:
    """What a Job's worker computes and where it writes: the invocation its container args
    say (read by the worker's own parser) without what only changes how it runs or logs
    (device, log format, -v), for adoption; None: not an esd-worker command this reads."""
    try:
        worker = parse_command(args)
    except InvalidInvocation:
        return None
    return worker.replace(device=None, log_format=None, verbose=False)


def worker_passthrough_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The PASSTHROUGH_ENV variables set in the controller's environment, for the Jobs."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in PASSTHROUGH_ENV if environ.get(name)}


_JOB_FIELD_FLAGS = {
    "image:": "--image:", "namespace:": "--namespace:", "node_selector:": "--node-selector:",
    "priority_class:": "--priority-class:", "service_account:": "--service-account:",
    "hf_token_secret:": "--hf-token-secret:", "s3_secret:": "--s3-secret:",
    "hf_cache_pvc:": "--hf-cache-pvc:", "cpu_request:": "--cpu-request:",
    "memory_request:": "--memory-request:", "kueue_queue:": "--kueue-queue:",
    "active_deadline_s:": "--active-deadline:", "gpus_per_job:": "--gpus-per-job:",
    "ephemeral_storage_request:": "--ephemeral-storage-request:",
    "ttl_after_finished_s:": "--ttl-after-finished:", "tolerations:": "--toleration:",
    "image_pull_secrets:": "--image-pull-secret:", "gpu_resource:": "--gpu-resource:",
}


def job_setting_problems(settings: ClusterSettings, gpus_per_job: int) -> list[str]:
    """JobSettings' problems for these flags, worded by flag name."""
    job = settings.job_settings(run_id="check", instance="check", gpus_per_job=gpus_per_job)
    out = []
    for problem in job.problems():
        for fieldname, flag in _JOB_FIELD_FLAGS.items():
            if problem.startswith(fieldname):
                problem = flag + problem[len(fieldname):]
                break
        out.append(problem)
    return out


def add_cluster_flags(g: Any) -> None:
    """The flags of `--backend kubernetes` (on `run` and `doctor`); cluster_from_args reads
    them."""
    add_flag(g, "--namespace", default=DEFAULT_NAMESPACE,
             help=f"namespace of the Jobs (default {DEFAULT_NAMESPACE})")
    add_flag(g, "--kube-context", metavar="NAME",
             help="kubeconfig context (default: the current one; in a pod: its service account)")
    # No default here: cluster_from_args tells an --image given from none (which
    # --worker-template refuses), then falls back to ESD_IMAGE and the built-in tag.
    add_flag(g, "--image", help="worker image with esd-worker (default: env ESD_IMAGE, else "
             f"{default_image()})")
    add_flag(g, "--worker-template", metavar="NAME",
             help="take the worker image from this PodTemplate in --namespace (its `worker` "
             "container), read when the run starts: the manifests' esd-sweep-worker, whose "
             "image kustomize's `images:` sets (not with --image)")
    add_flag(g, "--node-selector", action="append", default=[], metavar="KEY=VALUE",
             help="only nodes with this label (repeatable)")
    add_flag(g, "--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
             help="pods tolerate this taint, e.g. a GPU pool's dedicated=gpu:NoSchedule "
             "(repeatable; nvidia.com/gpu is tolerated already)")
    add_flag(g, "--image-pull-secret", action="append", default=[], metavar="NAME",
             help="Secret the pods pull the worker image with (private registry; "
             "repeatable)")
    add_flag(g, "--priority-class", metavar="NAME", help="priorityClassName of the pods")
    add_flag(g, "--service-account", default=DEFAULT_SERVICE_ACCOUNT, metavar="NAME",
             help=f"service account of the pods (default {DEFAULT_SERVICE_ACCOUNT})")
    add_flag(g, "--hf-token-secret", metavar="NAME[:KEY]",
             help="Secret holding the HF token (key default: token); given to pods by "
             "reference, never in arguments")
    add_flag(g, "--s3-secret", metavar="NAME",
             help="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (by reference; "
             "leave out for IRSA / pod identity)")
    add_flag(g, "--hf-cache-pvc", metavar="CLAIM",
             help="PersistentVolumeClaim shared as the HF cache (default: emptyDir per pod)")
    add_flag(g, "--cpu-request", default="2", metavar="Q", help="CPU request (default 2)")
    add_flag(g, "--gpu-resource", default=GPU_RESOURCE, metavar="NAME",
             help=f"the extended resource pods request per GPU (default {GPU_RESOURCE}; a "
             "MIG slice: nvidia.com/mig-1g.10gb); --max-parallel counts it")
    add_flag(g, "--memory-request", default=AUTO, metavar="Q|auto",
             help="memory request (default auto: sized from the weights' bytes, 4Gi plus "
             "0.4 x the model; 7Gi for models up to 8 GB)")
    add_flag(g, "--ephemeral-storage-request", default=AUTO, metavar="Q|auto",
             help="disk for downloads, also the cache volume's sizeLimit (default auto: "
             "sized from the weights' bytes)")
    add_flag(g, "--active-deadline", "--job-deadline", dest="active_deadline",
             type=int_in(1, MAX_JOB_S, unit="seconds"),
             metavar="S", help="seconds a worker pod may run once on a node; time pending "
             "does not count (default: 21600 with --shard-size 1, none for shard pods)")
    add_flag(g, "--ttl-after-finished", type=int_in(MIN_TTL_S, MAX_JOB_S, unit="seconds"),
             default=24 * 3600, metavar="S",
             help="seconds a finished worker Job is kept (default 86400)")
    add_flag(g, "--shard-size", type=int_in(0, 10**6), default=0, metavar="N",
             help="models per shard at most (default 0: auto, shards balanced by bytes, up "
             "to 1000 models each); 1: one Job per model instead of Indexed Jobs")
    add_flag(g, "--max-parallel", type=int_in(1, MAX_JOBS), default=100, metavar="GPUS",
             help="sharded runs: GPUs (--gpu-resource; CPU-only: pods) in use at once, all "
             "classes (default 100)")
    add_flag(g, "--hub-rate", type=HUB_RATE, default=3.0, metavar="PER_S",
             help="hub requests per second for the whole sweep, shared by its pods "
             "(default 3: the hub's free tier allows 1000 per 5 minutes)")
    add_flag(g, "--large-model-size", type=size_in(1), default=30 * 10**9, metavar="BYTES",
             help="models bigger than this run in the gpu-large class: more memory and disk "
             "(default 30G)")
    add_flag(g, "--poll-interval", type=float_in(0, HOUR_S, above=True, unit="seconds"),
             default=10.0, metavar="S",
             help="sharded runs: seconds between looks at the Indexed Jobs (default 10)")
    add_flag(g, "--max-active-jobs", type=int_in(1, MAX_JOBS), default=100, metavar="N",
             help="--shard-size 1: unfinished Jobs of this sweep at once (default 100)")
    add_flag(g, "--allow-pending", action="store_true",
             help="autoscaling clusters: submit Jobs even when telemetry sees no node with "
             "room, so they wait pending and the autoscaler adds nodes")
    add_flag(g, "--max-pending", type=int_in(1, MAX_JOBS), metavar="N",
             help="with --allow-pending: at most N Jobs not running yet")
    add_flag(g, "--do-not-disrupt", action="store_true",
             help="pods carry karpenter.sh/do-not-disrupt (no consolidation under a worker)")
    add_flag(g, "--kueue-queue", metavar="NAME",
             help="Kueue LocalQueue; Jobs are created suspended and Kueue admits them")
    add_flag(g, "--telemetry-selector", default=DEFAULT_TELEMETRY_SELECTOR, metavar="SELECTOR",
             help=f"label selector of the GPU exporter pods (default {DEFAULT_TELEMETRY_SELECTOR})")
    add_flag(g, "--telemetry-namespace", metavar="NS",
             help="namespace of the exporter pods (default: --namespace)")
    add_flag(g, "--telemetry-port", type=PORT, default=DEFAULT_TELEMETRY_PORT, metavar="PORT",
             help=f"exporter port (default {DEFAULT_TELEMETRY_PORT})")
    add_flag(g, "--telemetry-url", action="append", default=[], metavar="URL",
             help="scrape these /metrics URLs instead of exporter pods (repeatable)")
    add_flag(g, "--no-telemetry", action="store_true",
             help="no GPU telemetry: Jobs only request --gpu-resource")
    add_flag(g, "--pending-timeout", type=float_in(0, WEEK_S, above=True, unit="seconds"),
             default=600.0, metavar="S",
             help="report why a Job is not running after S seconds; sharded runs: a class "
             "whose pods no node can take for S seconds ends the run, exit 3 (default 600)")
    add_flag(g, "--allow-local-output", action="store_true",
             help="accept a local --output-dir (a volume mounted at that path in every pod)")
    wait = g.add_mutually_exclusive_group()
    add_flag(wait, "--wait", dest="wait", action="store_true", default=True,
             help="wait until every Job has ended (default)")
    add_flag(wait, "--no-wait", dest="wait", action="store_false",
             help="submit what fits and exit 0; Jobs keep running and a later run adopts them")


def cluster_from_args(args: argparse.Namespace, problems: list[str]) -> ClusterSettings:
    """ClusterSettings from `esd-sweep run`'s kubernetes flags (controller.cli declares
    them); their problems go to `problems`, each naming its flag."""
    selector: dict[str, str] = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"--node-selector: {item!r} is not KEY=VALUE")
        else:
            selector[key.strip()] = value.strip()
    tolerations = []
    for item in args.toleration:
        taint, sep, effect = item.rpartition(":")
        key, has_value, value = taint.partition("=")
        if not sep or not key:
            problems.append(f"--toleration: {item!r} is not KEY[=VALUE]:EFFECT "
                            "(e.g. dedicated=gpu:NoSchedule)")
        else:
            tolerations.append((key, value if has_value else None, effect))
    if args.image and args.worker_template:
        problems.append("give --image or --worker-template, not both (the template names "
                        "the worker image)")
    image = args.image or os.environ.get("ESD_IMAGE") or default_image()
    token = args.hf_token_secret
    if token and ":" not in token:
        token = f"{token}:token"
    cluster = ClusterSettings(
        namespace=args.namespace, kube_context=args.kube_context, image=image,
        worker_template=args.worker_template or None,
        node_selector=selector, priority_class=args.priority_class,
        service_account=args.service_account or None, hf_token_secret=token,
        s3_secret=args.s3_secret, hf_cache_pvc=args.hf_cache_pvc,
        image_pull_secrets=tuple(args.image_pull_secret), tolerations=tuple(tolerations),
        cpu_request=args.cpu_request, gpu_resource=args.gpu_resource,
        memory_request=args.memory_request,
        ephemeral_storage_request=args.ephemeral_storage_request,
        job_deadline_s=args.active_deadline, ttl_after_finished_s=args.ttl_after_finished,
        max_active_jobs=args.max_active_jobs,
        allow_pending=args.allow_pending, max_pending=args.max_pending,
        do_not_disrupt=args.do_not_disrupt, kueue_queue=args.kueue_queue,
        telemetry=not args.no_telemetry, telemetry_selector=args.telemetry_selector,
        telemetry_namespace=args.telemetry_namespace, telemetry_port=args.telemetry_port,
        telemetry_urls=tuple(args.telemetry_url), pending_timeout_s=args.pending_timeout,
        wait=args.wait, allow_local_output=args.allow_local_output,
        shard_size=args.shard_size, max_parallel=args.max_parallel, hub_rate=args.hub_rate,
        large_model_bytes=args.large_model_size, poll_interval_s=args.poll_interval,
    )
    if args.backend == "kubernetes":
        problems.extend(cluster.problems())
        gpus = 0 if args.device == "cpu" else (
            1 if args.gpus_per_job is None else args.gpus_per_job)  # auto: 1, the rule may add
        problems.extend(job_setting_problems(cluster, gpus))
        if args.mode == "custom":
            problems.append("--mode custom runs on the local backend only")
    return cluster
