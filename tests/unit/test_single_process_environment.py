"""A plain `python -m vldist.train` becomes a world of one for DeepSpeed; a launcher's variables
are never touched."""

from vldist.launch.environment import adopt_single_process_environment


def test_no_launcher_becomes_a_world_of_one_on_a_free_loopback_port():
    env = {}
    assert adopt_single_process_environment(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(env["MASTER_PORT"]) < 65536


def test_a_launchers_variables_are_kept():
    env = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert not adopt_single_process_environment(env)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
