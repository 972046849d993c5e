from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from kvpool.cli import main, parse_token_ids
from kvpool.kv_events import BlockStored


def test_hash_prints_the_published_keys(hash_vectors: dict, capsys) -> None:
    case = hash_vectors["cases"][1]
    assert (
        main(
            [
                "hash",
                case["token_ids"],
                "--block-size",
                str(case["block_size"]),
                "--seed",
                case["seed"],
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# sha256_cbor/bs64/")
    keys = [int(line.split("\t")[1]) for line in lines[1:]]
    assert keys == [b["key_u64"] for b in case["blocks"]]


@pytest.mark.parametrize("bad", ["1..x", "5..1", "-3", "seven"])
def test_hash_refuses_bad_token_lists_with_a_clear_error(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["hash", bad])
    assert exit_info.value.code == 2
    assert "token id" in capsys.readouterr().err


def test_hash_refuses_a_bad_block_size(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["hash", "1..32", "--block-size", "0"])
    assert "block_size must be at least 1" in capsys.readouterr().err


def test_token_lists_accept_commas_spaces_and_ranges() -> None:
    assert parse_token_ids("1,2 3..5") == [1, 2, 3, 4, 5]


async def test_events_listen_prints_a_workers_events_as_json_lines(make_publisher) -> None:
    pub = make_publisher()
    for i in range(3):
        pub.publish(
            [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i], block_size=1)]
        )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvpool.cli",
        "events",
        "listen",
        pub.endpoint,
        "--replay",
        pub.replay_endpoint,
        "--from-seq",
        "0",
        "--count",
        "3",
        env={**os.environ, "PYTHONSAFEPATH": "1"},  # see the Makefile: operator/ at the root
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 2]
    assert lines[2]["events"][0]["type"] == "BlockStored"
    assert lines[2]["events"][0]["block_hashes"] == [2]


@pytest.mark.parametrize("component", ["router", "worker"])
def test_serve_help_says_a_required_flag_is_required(component: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([component, "serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
    assert "PydanticUndefined" not in out
    out = out.split(" options: ", 1)[1]  # the flags' help, after the usage line
    model = out.split("--model MODEL", 1)[1].split(" --", 1)[0]
    assert "required" in model
    assert "model directory" in model  # the field's description
    if component == "router":
        worker = out.split("--worker WORKER", 1)[1].split(" --", 1)[0]
        assert "default none; repeat for several" in worker


def test_route_against_a_router_that_is_not_there_says_so_in_one_line(capsys) -> None:
    from conftest import unique_port

    url = f"http://127.0.0.1:{unique_port()}"  # nothing listens there
    assert main(["router", "route", "--router", url, "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvpool router route: no answer from {url}: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
