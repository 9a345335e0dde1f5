"""`ringtrain plan`: tables, files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.cli import main, parse_count, parse_gpus


def test_table_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", "resnet101", "--gpus", "8,16,...,512", "--gpus-per-host", "4",
               "--network", "25gbit", "--strategy", "ring,ps"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "strategy ring" in out and "strategy ps" in out
    rows = [line for line in out.splitlines() if line.rstrip().endswith("%") and line[:7].strip().isdigit()]
    assert len(rows) == 14  # 7 GPU counts x 2 strategies
    assert "44.5M parameters" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8,16,...,512", [8, 16, 32, 64, 128, 256, 512]), ("4,8,...,20", [4, 8, 16, 20]),
     ("8,16,...,40", [8, 16, 32, 40]), ("10,20,...,50", [10, 20, 40, 50]), ("3, 5 ,...,11", [3, 5, 7, 9, 11]),
     ("16", [16])],
)
def test_gpu_lists(text: str, expected: list[int]) -> None:
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["", "8,x", "0,8", "16,8", "8,...", "...,8", "8,8"])
def test_bad_gpu_lists(text: str) -> None:
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus(text)


def test_counts() -> None:
    assert parse_count("300M") == 300_000_000
    assert parse_count("25.6e6") == 25_600_000
    assert parse_count("1.5B") == 1_500_000_000
    with pytest.raises(ConfigError, match="--params"):
        parse_count("many")


_PARALLEL = ["--parallel", "--params", "1B", "--layers", "24", "--gpus", "16", "--global-batch", "128",
             "--step-ms", "100"]
_CUSTOM = ["--model", "custom", "--params", "300M", "--step-ms", "370", "--gpus", "1,40", "--gpus-per-host", "8"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--gpus", "8,x"], "--gpus"),
        (["--model", "alexnet"], "unknown model 'alexnet'"),
        (["--network", "carrier-pigeon"], "unknown --network"),
        (["--intra", "usb"], "unknown --intra"),
        (["--strategy", "gossip"], "unknown strategy 'gossip'"),
        (["--framework", "mxnet"], "unknown framework 'mxnet'"),
        (["--model", "custom"], "--params"),
        (["--model", "custom", "--params", "300M"], "--step-ms"),
        (["--model", "vgg16", "--gpu", "v100", "--batch", "32"], "--step-ms"),
        (["--gpus-per-host", "0"], "--gpus-per-host"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--module", "no_such_pkg:f", "--model", "custom", "--step-ms", "5"], "cannot import"),
        (["--plot", "/no/such/folder/x.png"], "does not exist"),
        (_CUSTOM + ["--backward-fraction", "1"], "backward fraction must be >= 0 and < 1, got 1.0"),
        (_CUSTOM + ["--backward-fraction", "-0.2"], "backward fraction must be >= 0 and < 1, got -0.2"),
        (_CUSTOM + ["--backward-fraction", "nan"], "--backward-fraction must be a finite number, got nan"),
        (_CUSTOM + ["--backward-fraction", "most"], "--backward-fraction: invalid float value"),
        (_CUSTOM + ["--layers", "0"], "layer count of a custom model must be a whole number >= 1, got 0"),
        (_CUSTOM + ["--layers", "2.5"], "--layers: invalid int value"),
        (["--model", "vgg16", "--layers", "4"], "--layers 4 only applies to --model custom --params N"),
        (["--model", "vgg16", "--params", "1.2M", "--step-ms", "18"],
         "--params describes a custom model but --model is vgg16; drop --model vgg16 or pass --model custom"),
        (["--model", "resnet50", "--module", "ringtrain.plan.calibrate:mnist_cnn", "--step-ms", "18"],
         "--module describes a custom model but --model is resnet50"),
        (["--params", "1M", "--module", "ringtrain.plan.calibrate:mnist_cnn", "--step-ms", "5"],
         "--params and --module both describe the model; give one"),
        (["--network", "nan"], "--network must be a positive number of Gbit/s"),
        (["--network", "inf"], "--network must be a positive number of Gbit/s"),
        (["--gpus", "8,16", "--jitter", "nan"], "--jitter must be a finite number, got nan"),  # hung before
        (["--step-ms", "inf"], "--step-ms must be a finite number, got inf"),
        (["--bucket-mb", "nan"], "--bucket-mb must be a finite number, got nan"),
        (["--json", "/"], "--json '/' is a folder; give a file path"),
        (["--plot", "/tmp/efficiency.txt"], "write a .png, .svg or .pdf path"),
        (["--layout", "2x1x4"], "--layout only applies with --parallel; add --parallel or drop --layout"),
        (["--device-memory", "80"], "--device-memory only applies with --parallel"),
        (["--sync-every", "5"], "--sync-every only applies with --lowcomm; add --lowcomm or drop --sync-every"),
        (["--params", "1M", "--step-ms", "5", "--input-shape", "3,8,8"], "--input-shape applies to a --module model"),
        (["--ps-shards", "2"], "--ps-shards and --ps-per-host describe parameter servers; add ps to --strategy"),
        (["--ps-per-host", "--strategy", "ring"], "--ps-shards and --ps-per-host describe parameter servers"),
        (["--inter", "hd"], "--inter is the across-host algorithm of --strategy hierarchical"),
        (["--validate", "--json", "v.json"], "--validate prints its table and writes no JSON; drop --json"),
        (["--jitter", "-1"], "--jitter must be >= 0 (a spread of step times), got -1"),
        (["--batch", "0"], "--batch must be >= 1 sample per GPU, got 0"),
        (["--lowcomm", "--params", "1M", "--step-ms", "5", "--sync-every", "0,10"],
         "--sync-every '0,10': give whole numbers >= 1"),
        (["--lowcomm", "--params", "1M", "--step-ms", "5", "--fragments", "0"], "--fragments must be >= 1, got 0"),
        (["--lowcomm", "--plot", "x.png"], "--plot draws the data-parallel scaling plan; drop it with --lowcomm"),
        (["--module", "ringtrain.plan.calibrate:mnist_cnn", "--input-shape", "3,224,224", "--step-ms", "5"],
         "failed on an input of shape 3,224,224"),
        (["--module", "ringtrain.plan.calibrate:mnist_cnn", "--input-shape", "0", "--step-ms", "5"],
         "--input-shape '0': write whole numbers >= 1"),
        (_PARALLEL + ["--layout", "32x1x1", "--gpus", "32"], "32 pipeline stages for 24 layers"),
        (_PARALLEL + ["--layout", "1x2x8", "--heads", "3"], "2 tensor ranks do not divide --heads 3"),
        (_PARALLEL + ["--microbatches", "0", "--device-memory", "80"], "--microbatches must be >= 1, got 0"),
        (_PARALLEL + ["--device-memory", "0"], "--device-memory must be > 0 GiB, got 0"),
        (_PARALLEL + ["--global-batch", "-3", "--device-memory", "8"], "--global-batch must be >= 1, got -3"),
        # These were read by no code of the mode: silently without effect.
        (["--validate", "--gpus", "8"], "--gpus has no effect with --validate; drop --gpus"),
        (["--calibrate", "--model", "vgg16"], "--model has no effect with --calibrate; drop --model"),
        (_PARALLEL + ["--device-memory", "80", "--gpu", "v100"], "--gpu has no effect with --parallel"),
        (_PARALLEL + ["--device-memory", "80", "--strategy", "ps"], "--strategy has no effect with --parallel"),
        (["--lowcomm", "--baseline-gpus", "2"], "--baseline-gpus has no effect with --lowcomm"),
        (["--model", "vgg16", "--gpu", "v100", "--step-ms", "50"],
         "--gpu picks the catalogue's step time, and --step-ms replaces it; drop one"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_custom_model_by_size(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", "custom", "--params", "300M", "--step-ms", "370", "--gpus", "1,40",
               "--gpus-per-host", "8", "--network", "ib-fdr", "--framework", "flat"])
    assert rc == 0
    assert "1200 MB of fp32 gradients" in capsys.readouterr().out


def test_custom_model_options_reach_the_prediction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def exposed_at_40(*extra: str) -> float:
        js = tmp_path / "plan.json"
        assert main(_CUSTOM + ["--framework", "per-tensor", "--json", str(js), *extra]) == 0
        return float(json.loads(js.read_text())["strategies"]["ring"][-1]["exposed_s"])

    default = exposed_at_40()
    assert "300M parameters in 32 equal layers" in capsys.readouterr().out
    assert exposed_at_40("--backward-fraction", "0.9") < default < exposed_at_40("--backward-fraction", "0.3")
    assert exposed_at_40("--layers", "1") > default


def test_params_alone_plan_that_model_not_the_default_one(capsys: pytest.CaptureFixture[str]) -> None:
    # Before, --params without --model custom was ignored and the plan was resnet50's.
    assert main(["--params", "1.2M", "--step-ms", "18", "--gpus", "2", "--gpus-per-host", "1"]) == 0
    out = capsys.readouterr().out
    assert "custom (1.2M parameters" in out and "resnet50" not in out
    assert main(["--gpus", "8"]) == 0  # nothing about the model: the default, resnet50
    assert "model resnet50" in capsys.readouterr().out


def test_lowcomm_takes_the_bucket_size_and_the_framework_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    # Before, --lowcomm put DDP's 25 MB buckets in place of both, without a word.
    base = ["--lowcomm", "--params", "1.2M", "--step-ms", "18", "--gpus", "4", "--gpus-per-host", "1"]

    def header(*extra: str) -> str:
        assert main(base + list(extra)) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("framework"))

    assert header().startswith("framework ddp: buckets 25 MB")
    assert header("--bucket-mb", "1").startswith("framework ddp: buckets 1 MB")
    assert header("--framework", "horovod").startswith("framework horovod")


def test_parallel_plans_pay_the_round_trip_they_are_given(tmp_path: Path) -> None:
    argv = _PARALLEL + ["--hidden", "2048", "--seq", "512", "--global-batch", "64", "--network", "1gbit",
                        "--layout", "4x1x4"]

    def step(*extra: str) -> float:
        out = tmp_path / "p.json"
        assert main(argv + ["--json", str(out), *extra]) == 0
        return float(json.loads(out.read_text())[0]["step_s"])

    assert step("--rtt-ms", "50") > step() * 1.2  # before, --rtt-ms was dropped here


def test_a_bare_plot_name_reports_the_png_it_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert main(["--gpus", "8,16", "--plot", str(tmp_path / "eff")]) == 0
    assert (tmp_path / "eff.png").is_file()
    assert f"wrote {tmp_path / 'eff.png'}" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback() -> None:
    # ``ringtrain plan ... | head -1``: the pipe's read end is closed before the command
    # writes, so its first print meets a broken pipe every time.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "ringtrain.cli", "plan", "--gpus", "8"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert res.returncode == 141 and "Traceback" not in res.stderr and res.stderr == ""


def test_custom_model_from_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", "custom", "--module", "ringtrain.plan.calibrate:mnist_cnn",
               "--input-shape", "1,28,28", "--step-ms", "80", "--gpus", "1,2,4", "--gpus-per-host", "2"])
    assert rc == 0
    assert "1.2M parameters" in capsys.readouterr().out


def test_json_and_plot_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "eff.png", tmp_path / "plan.json"
    rc = main(["--model", "vgg16", "--gpus", "8,16,32", "--strategy", "all", "--plot", str(png), "--json", str(js)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert set(data["strategies"]) == {"ring", "hd", "hierarchical", "ps"}
    effs = [row["efficiency"] for row in data["strategies"]["ring"]]
    assert all(0 < e <= 1 for e in effs)


def test_validate_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "| horovod-vgg16-512-roce | 512 | 68 |" in out
    assert "predictions within 5 points" in out


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--gpus-per-host" in capsys.readouterr().out
