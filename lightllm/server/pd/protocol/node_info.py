"""What a prefill or decode node tells the PD master when it registers, and who may join whom.

A KV cache moved from a prefill node (P) to a decode node (D) is only meaningful when both
run the same model with the same KV layout, so every node of one cluster must agree on
:data:`COMPATIBILITY_FIELDS`: the model, the KV dtype, the number of layers, the KV heads,
the head dimension and the TP size (each TP rank moves its own KV-head shard, so the shards
must line up rank for rank).  A mismatch found only at transfer time shows up as a hang or
as garbage text; the master refuses it at registration instead, naming every field that
differs.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple

from lightllm.common.basemodel.kv_head_split import kv_head_split_problem
from lightllm.common.sampling.logprobs_mode import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES
from lightllm.server.pd.protocol.host_port import HostPortError, parse_host_port
from lightllm.server.run_mode import PD_NODE_MODES, RunMode

PREFILL = RunMode.PREFILL.value
DECODE = RunMode.DECODE.value
ROLES: Tuple[str, ...] = PD_NODE_MODES

# KV dtypes a node may report (the names torch uses, without the ``torch.`` prefix).
KV_DTYPES: Tuple[str, ...] = ("float16", "bfloat16", "float32")

# The fields every node of one cluster must share, in the order mismatches are reported
# (checkpoint_fingerprint only between nodes that both report one).
COMPATIBILITY_FIELDS: Tuple[str, ...] = ("model_name", "dtype", "num_layers", "num_kv_heads", "head_dim", "tp_size",
                                         "checkpoint_fingerprint", "logprobs_mode")

# A node id (NodeInfo.node_id, --pd_node_id): safe in logs, metrics labels and URLs.
NODE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
# More end-of-sequence ids than any checkpoint names; bounds a registration body.
MAX_EOS_TOKEN_IDS = 64
_FINGERPRINT = re.compile(r"^[0-9a-f]{0,64}$")


class NodeInfoError(ValueError):
    """A registration body that is not a valid :class:`NodeInfo`; ``param`` names the bad field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _check_address(name: str, value: object) -> str:
    """``value`` if it is a ``host:port`` of the contract (:func:`~.host_port.parse_host_port`)."""
    try:
        parse_host_port(value)
    except HostPortError as exc:
        raise NodeInfoError(f"{name} {exc}", name) from None
    return value


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NodeInfoError(f"{name} must be a positive integer, got {value!r}", name)
    return value


@dataclass(frozen=True)
class NodeInfo:
    """One node's registration: who it is, what it serves and where to reach it.

    Attributes:
        node_id: unique name of the node in the cluster (letters, digits, ``._:-``; at most 128).
        role: ``"prefill"`` or ``"decode"``.
        model_name: the model the node serves (the served name, identical on P and D).
        dtype: the KV cache dtype, one of :data:`KV_DTYPES`.
        num_layers: transformer layers (each has its own KV).
        num_kv_heads: KV heads of the whole model (before the TP split).
        head_dim: size of one KV head.
        tp_size: tensor-parallel ranks of the node.
        http_address: ``host:port`` of the node's HTTP/control endpoint (the master calls it); an
            IPv6 host in brackets (:mod:`~.host_port`, as for ``kv_transfer_address``).
        kv_transfer_address: a prefill node's ``host:port``, where the transfer groups of its
            pairs meet (rank r at port + r); empty for a decode node, which hosts none.
        checkpoint_fingerprint: digest of the node's weights
            (:func:`~lightllm.common.basemodel.checkpoint_fingerprint.checkpoint_fingerprint`);
            empty when the registering process does not know it (compared only when both have one).
        eos_token_ids: the ids the node's ranks stop generation at (``--eos_id`` or the checkpoint's);
            None when the registering process does not report them.  The master stops where its
            nodes do only if its own set is the same, so it admits only such nodes.
        max_req_total_len: the most prompt plus generated tokens the node takes per request
            (``--max_req_total_len`` or the model's context); None when the registering process
            does not report it.  The master admits a request up to its own limit and may place it
            on any node, so it admits only nodes whose limit is at least its own.
        logprobs_mode: ``--logprobs_mode``; the prefill node reports the first token's logprob and
            the decode node the rest, so one answer's logprobs mean one thing only if both agree.
        request_slots: the node's request slots (each generation a master sends it holds one); the
            master lets one request run at most half the smallest node's, as a normal server does
            with its own.  None when the registering process does not report it.
        top_logprob_slots: the node's top-logprob rows (``--top_logprobs_slots``; each generation
            asking for top logprobs holds one); the master lets such a request run at most half the
            smallest node's.  None when the registering process does not report it.
    """

    node_id: str
    role: str
    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    http_address: str
    kv_transfer_address: str
    checkpoint_fingerprint: str = ""
    eos_token_ids: Optional[List[int]] = None
    max_req_total_len: Optional[int] = None
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    request_slots: Optional[int] = None
    top_logprob_slots: Optional[int] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`NodeInfoError` naming the first invalid field."""
        if not isinstance(self.node_id, str) or not NODE_ID_PATTERN.fullmatch(self.node_id):
            raise NodeInfoError(
                f"node_id must be 1-128 characters of letters, digits and '._:-' starting with a letter "
                f"or digit, got {self.node_id!r}",
                "node_id",
            )
        if self.role not in ROLES:
            raise NodeInfoError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}", "role")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise NodeInfoError(f"model_name must be a non-empty string, got {self.model_name!r}", "model_name")
        if self.dtype not in KV_DTYPES:
            raise NodeInfoError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}", "dtype")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size"):
            _check_positive_int(name, getattr(self, name))
        if kv_head_split_problem(self.num_kv_heads, self.tp_size) is not None:
            raise NodeInfoError(
                f"num_kv_heads ({self.num_kv_heads}) and tp_size ({self.tp_size}) must divide one another",
                "tp_size",
            )
        _check_address("http_address", self.http_address)
        if self.role == PREFILL:
            _check_address("kv_transfer_address", self.kv_transfer_address)
        elif self.kv_transfer_address != "":
            # Nothing would listen there: a decode node's ranks connect to the prefill node's.
            raise NodeInfoError(f"kv_transfer_address must be empty for a decode node (it hosts no transfer "
                                f"group), got {self.kv_transfer_address!r}", "kv_transfer_address")
        if not isinstance(self.checkpoint_fingerprint, str) or not _FINGERPRINT.fullmatch(self.checkpoint_fingerprint):
            raise NodeInfoError(f"checkpoint_fingerprint must be empty or 1-64 hex digits, got "
                                f"{self.checkpoint_fingerprint!r}", "checkpoint_fingerprint")
        eos = self.eos_token_ids
        if eos is not None and not (isinstance(eos, list) and len(eos) <= MAX_EOS_TOKEN_IDS and all(
                isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0 for token_id in eos)):
            raise NodeInfoError(f"eos_token_ids must be null or a list of at most {MAX_EOS_TOKEN_IDS} token ids, "
                                f"got {eos!r}", "eos_token_ids")
        if self.max_req_total_len is not None:
            _check_positive_int("max_req_total_len", self.max_req_total_len)
        for name in ("request_slots", "top_logprob_slots"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise NodeInfoError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
                                "logprobs_mode")

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> "NodeInfo":
        """Build from a registration body; unknown or missing fields are refused by name."""
        if not isinstance(body, Mapping):
            raise NodeInfoError(f"the registration body must be a JSON object, got {type(body).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(body) - set(names))
        if unknown:
            raise NodeInfoError(f"unknown registration field(s): {', '.join(unknown)}", unknown[0])
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = [name for name in names if name not in body and name not in optional]
        if missing:
            raise NodeInfoError(f"missing registration field(s): {', '.join(missing)}", missing[0])
        return cls(**{name: body[name] for name in names if name in body})

    def to_dict(self) -> Dict[str, Any]:
        """The JSON registration body (round-trips through :meth:`from_dict`)."""
        return asdict(self)

    def describe(self) -> str:
        """``node 'p0' (prefill at 10.0.0.1:8000)`` -- how logs and errors name the node."""
        return f"node {self.node_id!r} ({self.role} at {self.http_address})"


def compatibility_mismatches(reference: NodeInfo, candidate: NodeInfo) -> List[str]:
    """One ``"field: candidate value != reference value"`` line per field in which they differ."""
    return [
        f"{name}: {getattr(candidate, name)!r} != {getattr(reference, name)!r}"
        + (" (other weights under the same model name)" if name == "checkpoint_fingerprint" else "")
        for name in COMPATIBILITY_FIELDS
        if getattr(candidate, name) != getattr(reference, name)
        and not (name == "checkpoint_fingerprint" and not (candidate.checkpoint_fingerprint
                                                            and reference.checkpoint_fingerprint))
    ]
