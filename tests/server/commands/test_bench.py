"""`pagedserve bench serve` against a real server (in-process, the tiny random-weight model),
`bench offline` on the tiny model: the JSON's numbers agree with each other and with what was
asked, the PNG opens, bad flags are a clear exit 2."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.cli import main
from pagedserve.server.commands.bench.stats import parse_slos
from pagedserve.server.commands.bench.workload import arrival_gaps, file_requests, random_requests
from tests.server.conftest import TINY, TINY_ARCHIVE

NUM, OUT = 4, 4


@pytest.fixture(scope="module")
def bench_server(inprocess_factory):
    return inprocess_factory(load_models=[f"{TINY}={TINY_ARCHIVE}"])


def check_distribution(dist: dict) -> None:
    assert dist["p50"] <= dist["p90"] <= dist["p99"]
    assert dist["median"] == pytest.approx(dist["p50"])
    assert dist["mean"] > 0


def check_png(path) -> None:
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size[0] > 300 and img.size[1] > 200
        img.load()


def test_bench_serve_concurrency_sweep(bench_server, tmp_path, capsys):
    result = tmp_path / "serve.json"
    argv = [
        "bench",
        "serve",
        "--url",
        bench_server.url("inference"),
        "--api-key",
        bench_server.keys["inference"],
        "--concurrency",
        "1",
        "2",
        "--num-prompts",
        str(NUM),
        "--random-input-len",
        "24",
        "--random-output-len",
        str(OUT),
        "--goodput",
        "ttft:600000",
        "e2el:600000",
        "--result-json",
        str(result),
        "--disable-tqdm",
    ]
    assert main(argv) == 0
    record = json.loads(result.read_text())
    assert record["model"] == TINY and record["kind"] == "serve"
    # named like every benchmark's result (the shared harness): commit, CPU, load, peak memory
    assert record["commit"] != "unknown" and record["cpu"] and record["cpu_kind"] and record["peak_rss_mib"] > 0
    assert [lv["level"] for lv in record["levels"]] == ["c=1", "c=2"]
    for lv in record["levels"]:
        assert lv["completed"] == NUM and lv["failed"] == 0 and lv["errors"] == []
        assert lv["total_output_tokens"] == NUM * OUT  # ignore_eos: exactly max_tokens each
        assert lv["total_input_tokens"] >= NUM * 24
        assert lv["request_throughput"] == pytest.approx(NUM / lv["duration_s"])
        assert lv["output_throughput"] == pytest.approx(NUM * OUT / lv["duration_s"])
        assert lv["goodput"] == pytest.approx(lv["request_throughput"])  # every request met SLOs
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            check_distribution(lv[key])
        assert lv["ttft_ms"]["median"] <= lv["e2el_ms"]["median"]
        assert lv["e2el_ms"]["p99"] <= lv["duration_s"] * 1000
    check_png(result.with_suffix(".png"))
    out = capsys.readouterr().out
    assert "c=2" in out and f"results: {result}" in out


def test_bench_serve_request_rate_and_goodput(bench_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Once upon a time", "max_tokens": 3}\n"plain"\n'.replace('"plain"', '{"prompt": "Hello there"}')
    )
    result = tmp_path / "rate.json"
    argv = [
        "bench",
        "serve",
        "--url",
        bench_server.url("inference"),
        "--api-key",
        bench_server.keys["inference"],
        "--model",
        TINY,
        "--request-rate",
        "inf",
        "--max-concurrency",
        "2",
        "--num-prompts",
        "3",
        "--dataset",
        "file",
        "--dataset-path",
        str(prompts),
        "--random-output-len",
        "2",
        "--goodput",
        "ttft:0.0001",
        "--result-json",
        str(result),
        "--no-plot",
        "--disable-tqdm",
        "--warmup",
        "0",
    ]
    assert main(argv) == 0
    [lv] = json.loads(result.read_text())["levels"]
    assert lv["level"] == "inf req/s, c<=2" and lv["completed"] == 3
    assert lv["total_output_tokens"] == 3 + 2 + 3  # the file's max_tokens, else the flag's
    assert lv["good_requests"] == 0 and lv["goodput"] == 0  # nothing answers in 0.1 us
    assert not result.with_suffix(".png").exists()


def test_bench_serve_refuses_bad_flags(tmp_path, capsys):
    base = ["bench", "serve", "--url", "http://127.0.0.1:9", "--result-dir", str(tmp_path)]
    assert main([*base, "--goodput", "latency:5"]) == 2
    assert "goodput: 'latency:5'" in capsys.readouterr().err
    assert main([*base, "--concurrency", "0"]) == 2
    assert "concurrency" in capsys.readouterr().err
    assert main([*base, "--dataset", "file"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_workloads():
    reqs = random_requests(5, 10, 7, range_ratio=0.5, seed=1)
    assert reqs == random_requests(5, 10, 7, range_ratio=0.5, seed=1)
    assert all(5 <= len(r.prompt.split()) - 1 <= 15 and 3 <= r.max_tokens <= 10 for r in reqs)
    assert len({r.prompt.split()[0] for r in reqs}) == 5  # no shared prefix between requests
    gaps = list(arrival_gaps(200, 10.0, seed=2))
    assert gaps[0] == 0 and 0.05 < sum(gaps) / 199 < 0.2  # mean gap about 1 / rate
    assert list(arrival_gaps(3, float("inf"))) == [0, 0, 0]
    assert parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="must be > 0"):
        parse_slos(["e2el:0"])


def test_file_dataset_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="entry 0 needs a string 'prompt'"):
        file_requests(bad, 2, 4)
    lines = tmp_path / "lines.txt"
    lines.write_text("a\n\nb\n")
    assert [r.prompt for r in file_requests(lines, 3, 4)] == ["a", "b", "a"]


def test_bench_offline(tiny_model, tmp_path):
    result = tmp_path / "offline.json"
    argv = [
        "bench",
        "offline",
        "--model",
        str(tiny_model),
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--batch-sizes",
        "1",
        "4",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--result-json",
        str(result),
        "--disable-tqdm",
    ]
    assert main(argv) == 0
    record = json.loads(result.read_text())
    assert [lv["batch_size"] for lv in record["levels"]] == [1, 4]
    for lv in record["levels"]:
        assert lv["total_output_tokens"] == 4 * 3 and lv["total_input_tokens"] == 4 * 8
        assert lv["output_throughput"] == pytest.approx(12 / lv["duration_s"])
        assert lv["e2el_ms"]["p99"] <= lv["duration_s"] * 1000 * 1.01
    check_png(result.with_suffix(".png"))
