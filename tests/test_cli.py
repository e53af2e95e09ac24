"""The headless server's command line: one flag per engine setting, made from EngineConfig's fields."""

import dataclasses

import pytest

from engine.config import EngineConfig
from entrypoints.cli import SERVE_DEFAULTS, parse_args


def test_every_engine_setting_has_a_flag_with_its_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("model", "runner"):
            assert f"--{f.name.replace('_', '-')}" in text
            assert " ".join(f.metadata["help"].split()) in text


def test_only_the_flags_given_reach_the_engine_typed():
    args = parse_args(
        [
            "--model",
            "m",
            "--kvcache-block-size",
            "32",
            "--gpu-memory-utilization",
            "0.5",
            "--no-enable-prefix-caching",
            "--async-scheduling",
            "--attention-backend",
            "torch",
        ]
    )
    assert args.engine_settings == {
        **SERVE_DEFAULTS,
        "kvcache_block_size": 32,
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "async_scheduling": True,
        "attention_backend": "torch",
    }
    assert parse_args([]).engine_settings == SERVE_DEFAULTS  # the rest: the engine's own defaults
    EngineConfig.from_kwargs("m", **args.engine_settings)  # and the engine takes them as they are


@pytest.mark.parametrize("argv", [["--attention-backend", "cudnn"], ["--max-num-seqs", "many"]])
def test_a_bad_value_is_refused_before_anything_loads(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err


def test_pagoda_serve_is_installed_as_a_command_running_the_server_cli():
    """`pip install` puts a `pagoda-serve` command beside the venv's python; it is the same CLI as
    `python -m engine.serve`."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    command = Path(sysconfig.get_path("scripts")) / "pagoda-serve"
    assert command.exists(), f"{command} missing: reinstall the project (pip install -e .)"
    installed = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120)
    module = subprocess.run(
        [sys.executable, "-m", "engine.serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert installed.returncode == 0 and module.returncode == 0, installed.stderr + module.stderr
    assert "--max-num-seqs" in installed.stdout
    assert installed.stdout.split("\n", 1)[1] == module.stdout.split("\n", 1)[1]  # past the "usage: <prog>" line
