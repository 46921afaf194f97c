"""coordination.py in process, on a single-rank channel (no process group: `Solo`): the group that
agrees, node facts and shares, a stage's round, structure comparison and giving up are each what one
rank alone makes of them. (Many ranks: tests/test_agreement.py, test_node_facts.py, test_faults.py.)"""

from __future__ import annotations

from slackswap_ds.agreement import Solo
from slackswap_ds.config import load_config
from slackswap_ds.coordination import Coordinator
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import load_hardware, load_node

from conftest import two_region_profile


def coordinator(stage=None, members=None, **section) -> Coordinator:
    cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", **section}})
    return Coordinator(cfg, load_hardware(cfg.hardware), stage, members)


def test_one_rank_is_its_own_job_and_group():
    c = coordinator()
    channel, peers = c.agreement_group()
    assert isinstance(channel, Solo) and channel is c.job_channel() and peers is None
    assert (channel.rank, channel.world) == (0, 1) and c.group_size() == 1 and c.leads_group()
    assert c.via == "torch.distributed" and c.stage is None


def test_its_node_facts_give_it_the_whole_node_share_it_plans_with():
    """One rank on a DGX A100 preset: its switch's uplink is its own, and of the node's pool it
    gets its demand (its saved bytes above the budget: 60 - 30), which the pool can meet."""
    c = coordinator(node="dgx-a100", host_pool_bytes_per_node="1GiB")
    profile = two_region_profile()
    assert c.exchange_facts(profile, budget=30, shapes="(2, 8) torch.int64")  # one rank: one step
    shares = c.shares
    assert shares.own == shares.plan == shares.lead and shares.node_ranks == 1
    assert shares.own.host_pool_bytes == 60 - 30
    assert shares.own.d2h_bps == min(load_hardware("a100-80g-pcie4").d2h_bps, load_node("dgx-a100").switch_uplink_bps)


def test_a_stage_of_one_rank_agrees_alone_and_knows_its_plan():
    c = coordinator(stage=1, members=[0])
    channel, peers = c.agreement_group()
    assert isinstance(channel, Solo) and peers == [0] and c.leads_group()
    c.stage_round("ab" * 32, shared=True)
    assert c.stage_plans == {1: "ab" * 32}
    engine = coordinator()
    engine.stage_round("cd" * 32, shared=True)  # a data-parallel engine's group is the job: no round
    assert engine.stage_plans == {}


def test_structures_are_compared_and_programs_renumbered_without_a_process_group():
    c = coordinator()
    c.compare_structure("(2, 8) torch.int64", "ef" * 32)  # no store to publish to: nothing, no error
    assert c.ledger is None
    c.new_program()
    assert c.program == 1


def test_a_rank_alone_that_cannot_plan_raises_and_is_not_stopped():
    """give_up ends a job of several ranks (it shouts, lingers and exits); a rank alone just raises."""
    c = coordinator()
    c.job_channel()
    c.give_up(BudgetInfeasibleError("no plan"))  # returns: nobody to tell, the caller raises
    c.give_up(BudgetInfeasibleError("no plan again"))


def test_the_mpi_transport_without_mpi4py_names_the_mpi_extra(monkeypatch):
    """mpi4py is the `mpi` extra's (a single-node job never needs it): where it cannot be imported, the
    MPI channel, the node layout and a config's "sync": "mpi" under an MPI launcher say which extra
    installs it, instead of an ImportError from inside the agreement; "auto" uses torch.distributed."""
    import sys

    import pytest

    from slackswap_ds.channels import MpiChannel
    from slackswap_ds.errors import MissingExtraError
    from slackswap_ds.node_facts import node_layout

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if it were not installed
    extra = r"needs mpi4py, which cannot be imported here \(.*\): pip install 'slackswap_ds\[mpi\]'$"
    for make in (MpiChannel, node_layout):
        with pytest.raises(MissingExtraError, match=extra):
            make()
    monkeypatch.setenv("PMI_RANK", "0")  # launched by MPI (MPICH/Hydra)
    with pytest.raises(MissingExtraError, match='the MPI transport of the plan agreement \\("sync": "mpi"\\) ' + extra):
        coordinator(sync="mpi")
    assert coordinator(sync="auto").via == "torch.distributed"
