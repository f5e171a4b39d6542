"""The PD master's pair table (pd/master/pair_setup.py), checked against a recording stand-in of
the node client: one setup per (prefill, decode) pair on first use, prefill node first, epochs
never reused, teardown on the survivor when a node leaves, a half-done setup torn down.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Tuple

from pd_membership_support import FakeClock, node
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_streams import NodeCallError
from lightllm.server.pd.master.pair_setup import PairSetup
from lightllm.server.pd.protocol.membership import TRANSFER_TEARDOWN_PATH
from lightllm.server.pd.protocol.node_info import NodeInfo


class RecordingNodes:
    """Answers the master's JSON calls to nodes like a node would, and records them."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, str, int]] = []  # (node id, path, epoch)
        self.refuse: set = set()
        self.setup_delay = 0.0

    async def post_json(self, node: NodeInfo, path: str, body: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
        self.calls.append((node.node_id, path, body["epoch"]))
        if path != TRANSFER_TEARDOWN_PATH:
            await asyncio.sleep(self.setup_delay)
        if node.node_id in self.refuse:
            raise NodeCallError(node, f"{node.describe()} refused", 500)
        return {"epoch": body["epoch"]}

    def of(self, path_end: str) -> List[Tuple[str, int]]:
        return [(node_id, epoch) for node_id, path, epoch in self.calls if path.endswith(path_end)]


def test_pairs_are_set_up_once_on_first_use_and_torn_down_on_the_survivor() -> None:
    registry = NodeRegistry(clock=FakeClock())
    p0, d0, d1 = node("p0", "prefill"), node("d0", "decode", port=9100), node("d1", "decode", port=9200)
    for info in (p0, d0, d1):
        registry.register(info)
    nodes = RecordingNodes()

    async def scenario() -> None:
        pairs = PairSetup(registry, nodes, setup_timeout_s=5)  # type: ignore[arg-type]
        nodes.setup_delay = 0.05
        first, again, other = await asyncio.gather(pairs.pair_for(p0, d0), pairs.pair_for(p0, d0),
                                                   pairs.pair_for(p0, d1))
        assert first is again and {first.epoch, other.epoch} == {1, 2}
        # One setup per pair, P before D, each with its own epoch.
        setups = nodes.of("transfer_setup")
        assert sorted(setups) == sorted([("p0", first.epoch), ("d0", first.epoch), ("p0", other.epoch),
                                         ("d1", other.epoch)])
        assert setups.index(("p0", first.epoch)) < setups.index(("d0", first.epoch))
        assert await pairs.pair_for(p0, d0) is first and len(nodes.of("transfer_setup")) == 4
        assert pairs.epochs_of("p0") == sorted([first.epoch, other.epoch])

        registry.unregister("d0", "it stopped")  # the survivor p0 lets go of their epoch
        await pairs.aclose()
        assert nodes.of("transfer_teardown") == [("p0", first.epoch)]
        assert pairs.get("p0", "d0") is None and pairs.get("p0", "d1") is other

        pairs.invalidate(other.epoch, "d1 reported its transfer broken")  # both let go
        await pairs.aclose()
        assert sorted(nodes.of("transfer_teardown")[1:]) == [("d1", other.epoch), ("p0", other.epoch)]
        again = await pairs.pair_for(p0, d1)
        assert again.epoch == 3  # never an epoch used before

        # A setup that fails half way tears down the node already set up; a request that
        # waited meanwhile shares the failure instead of running a second full setup.
        registry.register(d0)
        nodes.refuse.add("d0")
        results = await asyncio.gather(pairs.pair_for(p0, d0), pairs.pair_for(p0, d0), return_exceptions=True)
        assert all(isinstance(r, ServerUnavailableError) and r.code == "pd_transfer_setup_failed" for r in results)
        await pairs.aclose()
        assert nodes.of("transfer_setup")[-2:] == [("p0", 4), ("d0", 4)]
        assert nodes.of("transfer_teardown")[-1] == ("p0", 4)

    asyncio.run(scenario())
