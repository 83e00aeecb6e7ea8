"""The default bucket caps over a real slow link (issue #35): two network namespaces joined by a veth pair shaped
with tbf at 1 Gbit/s (root; skipped saying why otherwise), one rank in each. A model that one default 25 MB bucket
holds whole goes to ``bucket_cap_mb="auto"``'s trials after its second backward, on both ranks at the same step;
one given ``bucket_cap_mb=25`` keeps its cap; both train to the same bits (2 ranks: any layout sums a/2 + b/2).
A 20 MB model at 200 Mbit/s, whose buckets go one at a time, is judged by its whole tail (the link re-shaped while
both ranks wait between the two: one process per rank runs both). The loopback half (a late peer is no slow wire) is
in test_reducer.py."""

import json
import os
import sys

import netns
import pytest
from test_multinode import Launch

from lockstep.process_group import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))


RATES = {"small": "1gbit", "serial": "200mbit"}  # each kind of link_scripts/default_caps.py, the link it runs over


def _rank(node, rank: int, port: str, go_dir: str) -> Launch:
    env = {**os.environ, "MASTER_ADDR": netns.ADDRS[0], "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
           "GLOO_SOCKET_IFNAME": node.interface, "PYTHONPATH": HERE}
    return Launch(node.command([sys.executable, os.path.join(HERE, "link_scripts", "default_caps.py"), *RATES,
                                "--go-dir", go_dir]), env)


def _run(nodes, go_dir: str) -> dict[str, list[dict]]:
    """Both ranks of link_scripts/default_caps.py, one process each for every kind (an interpreter each, not one a
    kind): the link is shaped for a kind while both ranks wait before it; each rank's JSON line per kind."""
    results: dict[str, list[dict]] = {}
    launches: list[Launch] = []
    try:
        for n, (kind, rate) in enumerate(RATES.items()):
            for node in nodes:
                node.shape(rate)
            if n == 0:
                port = str(free_port())
                launches = [_rank(node, rank, port, go_dir) for rank, node in enumerate(nodes)]
            else:
                open(os.path.join(go_dir, kind), "w").close()
            for launch in launches:
                launch.wait_for(f'"kind": "{kind}"', 240, stream="out")
            results[kind] = [json.loads(next(line for line in launch.out if f'"kind": "{kind}"' in line))
                             for launch in launches]
            for r in results[kind]:  # -n 0 -s shows them
                print(f"{kind} at {rate}, rank {r['rank']}: the second backward's last {r['tail'][0] / 1e6:.1f} MB "
                      f"took {r['tail'][1] * 1e3:.0f} ms after it; trials chose {r['chosen']}")
        for launch in launches:
            assert launch.finish(60) == 0, launch.text()[-4000:]
    finally:
        for launch in launches:
            launch.proc.kill()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with netns.two_nodes() as nodes:
        return _run(nodes, str(tmp_path_factory.mktemp("link_default_go")))


@pytest.fixture(scope="module")
def ranks(runs):
    return runs["small"]


def test_the_default_caps_go_to_trials_over_a_slow_link_on_every_rank_at_the_same_step(ranks):
    r0, r1 = ranks
    assert r0["votes"]["default"] and r1["votes"]["default"], (r0["tail"], r1["tail"])
    assert r0["tuned"] == r1["tuned"] == {"default": True, "fixed": False}, (r0["tail"], r1["tail"])
    assert r0["layouts"] == r1["layouts"] and r0["chosen"] == r1["chosen"]
    assert r0["layouts"][2] != r0["layouts"][1]  # the first trial (1 MB caps) from the third step on
    assert "on every rank: trying bucket caps (bucket_cap_mb='auto') over the next 20 steps" in r0["logs"][0]
    assert "bucket_cap_mb='auto' chose" in r0["logs"][1] and not r1["logs"], (r0["logs"], r1["logs"])


def test_a_fixed_cap_keeps_its_layout_and_both_train_to_the_same_bits(ranks):
    for rank in ranks:
        assert rank["same_bits"], rank["rank"]


def test_a_slow_wire_whose_buckets_go_one_at_a_time_is_judged_by_its_whole_tail(runs):
    # 20 MB at 200 Mbit/s: from the second backward on the buckets go one at a time (launch_order), so the tail is
    # spent launching them after the backward, not in the waits that follow; it is timed from the backward's end
    r0, r1 = runs["serial"]
    assert r0["serial"] and r1["serial"]
    assert r0["tail"][1] > 0.3 and r1["tail"][1] > 0.3, (r0["tail"], r1["tail"])
    assert r0["trials"] == r1["trials"] == {"default": True, "fixed": False}, (r0["tail"], r1["tail"])
