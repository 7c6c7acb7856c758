"""nshard/run/netcount.py: the kernel's count against the collectives' bytes, and when that is a disagreement."""

import os

import pytest

from nshard.cgroups import parse_cores
from nshard.run import netcount


class Logged:
    """Stands in for engine.CollectiveCounter: bytes since the last take()."""

    def __init__(self, *takes):
        self.takes = list(takes)

    def take(self):
        return self.takes.pop(0)


def finish(monkeypatch, kernel_sent, logged_reducer=1000, ledger=1000, other=0, interface="eth0", world=2):
    counts = iter([5000, 5000 + kernel_sent])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    monkeypatch.setattr(netcount, "tx_bytes", lambda name: next(counts) if name == "eth0" else None)
    taken = {"deepspeed_grad_bytes": 0, "logged_reducer_bytes": logged_reducer, "other_bytes": other}
    counter = netcount.LinkCount(Logged({}, taken))
    return counter.finish(0, world, ledger)


@pytest.mark.parametrize("kernel_sent, agree", [(1000, True), (1049, True), (1051, False), (949, False)])
def test_kernel_beyond_five_percent_is_a_disagreement(monkeypatch, capsys, kernel_sent, agree):
    link = finish(monkeypatch, kernel_sent)["link"]
    assert link["kernel_tx_bytes"] == kernel_sent and link["agree"] is agree
    assert ("byte counts disagree" in capsys.readouterr().err) is not agree


def test_every_collective_counts_and_a_ring_sends_2_w_minus_1_over_w(monkeypatch):
    assert finish(monkeypatch, 1200, other=200)["link"]["agree"] is True
    link = finish(monkeypatch, 1500, world=4)["link"]  # 4 ranks: 1.5 x the tensor per rank
    assert link["expected_wire_bytes"] == 1500 and link["agree"] is True


def test_ledger_that_differs_from_the_logger_is_a_disagreement(monkeypatch, capsys):
    link = finish(monkeypatch, 1000, ledger=996)["link"]
    assert link["ledger_matches_logger"] is False and link["agree"] is False
    assert "byte counts disagree" in capsys.readouterr().err


def test_no_link_interface_records_null(monkeypatch, capsys):
    body = finish(monkeypatch, 1000, interface="")
    assert body["link"]["kernel_tx_bytes"] is None and body["link"]["agree"] is None
    assert body["host"] and body["net_namespace"].startswith("net:[")
    assert parse_cores(body["cpus_allowed"]) == sorted(os.sched_getaffinity(0))  # the kernel's list, as it reads here
    assert capsys.readouterr().err == ""
