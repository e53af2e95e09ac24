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
        if f.name != "model":
            assert f"--{f.name.replace('_', '-')}" in text
            assert " ".join(f.metadata["help"].split()) in text


def test_only_the_flags_given_reach_the_engine_typed():
    args = parse_args(["--model", "m", "--kvcache-block-size", "32", "--gpu-memory-utilization", "0.5",
                       "--no-enable-prefix-caching", "--async-scheduling", "--attention-backend", "torch"])
    assert args.engine_settings == {**SERVE_DEFAULTS, "kvcache_block_size": 32, "gpu_memory_utilization": 0.5,
                                    "enable_prefix_caching": False, "async_scheduling": True,
                                    "attention_backend": "torch"}
    assert parse_args([]).engine_settings == SERVE_DEFAULTS  # the rest: the engine's own defaults
    EngineConfig.from_kwargs("m", **args.engine_settings)  # and the engine takes them as they are


@pytest.mark.parametrize("argv", [["--attention-backend", "cudnn"], ["--max-num-seqs", "many"]])
def test_a_bad_value_is_refused_before_anything_loads(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err
