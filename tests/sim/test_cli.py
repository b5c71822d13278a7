"""The ``pagedserve simulate`` subcommand (called directly, small workloads)."""

from __future__ import annotations

import argparse
import json

from pagedserve.sim import cli


def test_json_output_both_allocators_and_sweep(capsys) -> None:
    rc = cli.main(
        ["--num-requests", "40", "--num-slots", "8192", "--output", "json",
         "--sweep-block-size", "4,16", "--seed", "1"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"paged", "contiguous"}
    assert out["results"]["paged"]["completed"] == 40
    assert out["results"]["contiguous"]["completed"] == 40
    assert out["ratios"]["utilisation"] > 1.0
    assert [r["block_size"] for r in out["sweep"]] == [4, 16]
    assert out["sweep"][1]["half_block_size"] == 8.0


def test_text_output_file_workload_and_plots(tmp_path, capsys) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"arrival_step": i, "prompt_len": 30 + i, "output_len": 20, "n": 1 + i % 2})
            for i in range(12)
        )
    )
    rc = cli.main(
        ["--workload", str(path), "--num-slots", "1024", "--max-model-len", "128",
         "--reserve", "max_tokens", "--sweep-block-size", "8,16", "--plot", str(tmp_path / "p")]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "utilisation" in text and "paged / contiguous" in text and "block-size sweep" in text
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert names == [
        "block_size_sweep.png",
        "kv_memory.png",
        "running_requests.png",
        "slot_map.png",
    ]


def test_errors_exit_2(tmp_path, capsys) -> None:
    assert cli.main(["--workload", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_step": 0, "prompt_len": 5, "output_len": 0}\n')
    assert cli.main(["--workload", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_add_parser_registers_simulate() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["simulate", "--allocator", "paged", "--block-size", "8"])
    assert args.command == "simulate" and args.allocator == "paged" and args.block_size == 8
