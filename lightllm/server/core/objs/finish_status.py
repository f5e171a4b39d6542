"""How a request ended, as stored in its shared-memory record and reported to clients."""

FINISH_NONE = 0
FINISH_STOP = 1  # EOS or a stop token id (stop strings are decided by the detokenizer)
FINISH_LENGTH = 2  # max_new_tokens or max_req_total_len reached
FINISH_ABORT = 3  # client went away, stop string hit, or aborted before admission
# The model rank could not process this request (bad parameters read back, or its part of a
# batch failed); the rank carries on with the others and the client receives an error.
FINISH_ERROR = 4
# A PD prefill node's request ends here once the decode node acknowledged its KV; the request
# goes on there (never reported to a client of this node as a finish reason of its own).
FINISH_HANDED_OFF = 5
# PD decode node outcomes; the node's PD endpoint turns them into stream lines for the master,
# never a finish reason of a public API response:
# No KV (or no request slot) to reserve for a prefilled arrival; answered at once.  Which limit
# was hit travels beside it, in rank 0's "busy" PdNotice, not in the status.
FINISH_BUSY = 6
FINISH_SEGMENT_KV = 7  # KV ran out while decoding: the segment ends instead of pausing
FINISH_SEGMENT_LIMIT = 8  # --pd_max_segment_tokens tokens generated in this segment
# The prompt's KV never arrived intact (failed or timed-out transfer, broken group, lease expiry).
FINISH_TRANSFER_FAILED = 9
# The request's structured-output grammar could not go on (llguidance stopped it: a grammar that
# can never end, nesting or ambiguity past the parser's per-token limit).  The client's input, not
# a server fault: the client gets a 400 naming the grammar, not FINISH_ERROR's 500.
FINISH_GRAMMAR_FAILED = 10

FINISH_REASON_NAMES = {
    FINISH_NONE: None,
    FINISH_STOP: "stop",
    FINISH_LENGTH: "length",
    FINISH_ABORT: "abort",
    FINISH_ERROR: "error",
    FINISH_HANDED_OFF: "handed_off",
    FINISH_BUSY: "busy",
    FINISH_SEGMENT_KV: "segment_kv_pressure",
    FINISH_SEGMENT_LIMIT: "segment_limit",
    FINISH_TRANSFER_FAILED: "transfer_failed",
    FINISH_GRAMMAR_FAILED: "grammar_failed",
}
