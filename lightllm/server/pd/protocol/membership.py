"""How a node joins the master: the membership endpoints, their refusal code and the heartbeat defaults.

Both sides read these: the master serves the paths (:mod:`lightllm.server.pd.master.membership_api`)
and expires silent nodes by the heartbeat rule; a node's registration client calls the paths and
heartbeats at the interval the master expects.
"""

REGISTER_PATH = "/pd/register"
HEARTBEAT_PATH = "/pd/heartbeat"
NODES_PATH = "/pd/nodes"

# The error code of a heartbeat from a node the master does not know (it restarted or dropped
# the node): the node registers again.
UNKNOWN_NODE_CODE = "unknown_node"

DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_MAX_MISSED_HEARTBEATS = 3
