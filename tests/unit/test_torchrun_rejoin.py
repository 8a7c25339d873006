"""The rule behind the start-up warning of a torchrun job whose lost node could not rejoin
(vldist/launch/environment.py: rejoin_warning), on the variables torchrun's agent gives its ranks."""

import pytest

from vldist.launch.environment import rejoin_warning

# what torch 2.4+'s agent sets for a rank of a 2-node job with --max-restarts 3 and a c10d rendezvous
TWO_NODES = {
    "GROUP_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "WORLD_SIZE": "16",
    "LOCAL_WORLD_SIZE": "8",
}


def test_a_job_across_nodes_that_restarts_without_the_variable_is_warned_with_the_fix():
    said = rejoin_warning(TWO_NODES)
    assert said.startswith(
        "torchrun: this job spans 2 nodes and restarts its ranks (--max-restarts 3), but "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not set: a node lost and started again could not "
        "rejoin"
    ), said
    assert "pytorch/pytorch#147064" in said and "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's" in said
    assert "\n" not in said


@pytest.mark.parametrize(
    "change",
    [
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # the fix: and then the agent does not share its store
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"},
        {"GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "8"},  # one node: nothing to rejoin
        {"TORCHELASTIC_MAX_RESTARTS": "0"},  # no restarts: a lost node ends the job anyway
        {"TORCHELASTIC_USE_AGENT_STORE": None},  # torch < 2.4: no shared store
    ],
    ids=["variable-set", "store-not-shared", "one-node", "no-restarts", "older-torch"],
)
def test_no_warning_where_a_rejoin_works_or_cannot_happen(change):
    env = {k: v for k, v in {**TWO_NODES, **change}.items() if v is not None}
    assert rejoin_warning(env) is None


def test_no_warning_outside_torchrun():
    assert rejoin_warning({}) is None  # a plain process, Slurm's srun tasks, Ray Train's workers
    assert rejoin_warning({"SLURM_PROCID": "0", "RANK": "0", "WORLD_SIZE": "8"}) is None
