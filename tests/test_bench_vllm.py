"""examples/bench_vllm.py without vLLM: a stand-in LLM drives the timing, τ, row and failure logic.

vLLM itself cannot run here (no GPU); what is checked is everything around it: prompts go in chunks of b as
token-id prompts, the warm-up is excluded from tokens, time and τ, τ pools vLLM's counters over engines and
requests, outputs are compared with the AR run, and a failing method leaves error rows while the rest runs.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import bench_vllm  # noqa: E402
from bench_vllm import ACCEPTED, DRAFT_TOKENS, DRAFTS, PER_POS  # noqa: E402
from results_tables import bench_table  # noqa: E402


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class FakeLLM:
    """Stands in for `vllm.LLM`. Output of a prompt: `len + 2` tokens (one token changed when `differ`). Per
    request, as if speculating: 2 draft rounds of k=3, `len(prompt)` accepted tokens, position 1 accepted only for
    prompts of length >= 3; counters split over two engines (label sets) as vLLM reports them with DP."""

    def __init__(self, clock, tok_per_s, spec=False, differ=(), fail=()):
        self.clock, self.tok_per_s, self.spec, self.differ, self.fail = clock, tok_per_s, spec, differ, fail
        self.calls, self.c = [], {DRAFTS: [0, 0], ACCEPTED: [0, 0], DRAFT_TOKENS: [0, 0], PER_POS: [[0, 0, 0], [0, 0]]}

    def generate(self, prompts, params, use_tqdm=True):
        assert params == "greedy" and not use_tqdm and all(set(p) == {"prompt_token_ids"} for p in prompts)
        ids = [p["prompt_token_ids"] for p in prompts]
        self.calls.append([len(q) for q in ids])
        if any(q in self.fail for q in ids):
            raise ValueError("boom")
        outs = []
        for e, q in enumerate(ids):
            toks = list(range(len(q) + 2))
            if q in self.differ:
                toks[-1] = -1
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(toks))]))
            self.clock.t += len(toks) / self.tok_per_s
            if self.spec:
                i = e % 2
                self.c[DRAFTS][i] += 2
                self.c[ACCEPTED][i] += len(q)
                self.c[DRAFT_TOKENS][i] += 6
                self.c[PER_POS][i][0] += 2
                self.c[PER_POS][i][1] += len(q) >= 3
        return outs

    def get_metrics(self):
        assert self.spec, "AR runs need no counters"
        m = [SimpleNamespace(name="vllm:num_requests_running", value=1)]
        for i in (0, 1):
            m += [SimpleNamespace(name=n, value=self.c[n][i]) for n in (DRAFTS, ACCEPTED, DRAFT_TOKENS)]
            m.append(SimpleNamespace(name=PER_POS, values=list(self.c[PER_POS][i])))
        return m


PROMPTS = [[7] * n for n in (1, 2, 3, 4, 5)]


def test_measure_chunks_and_excludes_warmup(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_vllm.time, "perf_counter", clock)
    llm = FakeLLM(clock, tok_per_s=100.0, spec=True)
    res, outs = bench_vllm.measure(llm, PROMPTS, 2, "greedy", spec=True)
    assert llm.calls == [[1, 2], [1, 2], [3, 4], [5]]  # warm-up = first chunk, then chunks of b submitted together
    assert res["tokens"] == sum(len(q) + 2 for q in PROMPTS) == 25 and len(outs) == 5
    assert res["seconds"] == pytest.approx(0.25) and res["tok_per_s"] == pytest.approx(100.0)
    # timed requests only: 15 accepted over 10 rounds (with the warm-up it would be 18 / 14)
    assert res["tau"] == pytest.approx(2.5) and res["drafts"] == 10 and res["draft_tokens"] == 30
    assert res["accept_by_pos"] == [1.0, 0.3, 0.0]


def test_ar_measure_has_no_tau(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_vllm.time, "perf_counter", clock)
    res, _ = bench_vllm.measure(FakeLLM(clock, 50.0), PROMPTS, 8, "greedy", spec=False)
    assert res["tau"] is None and res["tok_per_s"] == pytest.approx(50.0) and res["batch"] == 8


def test_metrics_failure_keeps_the_throughput(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_vllm.time, "perf_counter", clock)
    llm = FakeLLM(clock, 100.0, spec=True)
    monkeypatch.setattr(llm, "get_metrics", lambda: (_ for _ in ()).throw(AssertionError("Stat logging disabled")))
    res, _ = bench_vllm.measure(llm, PROMPTS, 2, "greedy", spec=True)
    assert res["tok_per_s"] == pytest.approx(100.0) and res["tau"] is None
    assert res["tau_note"] == "LLM.get_metrics() failed: AssertionError('Stat logging disabled')"


def test_tau_without_drafts_says_why():
    zero = {DRAFTS: 0, ACCEPTED: 0, DRAFT_TOKENS: 0, PER_POS: []}
    assert bench_vllm.tau_between(zero, zero) == {"tau": None, "tau_note": "vLLM counted no draft rounds"}


def test_methods_rows_failures_and_table(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_vllm.time, "perf_counter", clock)
    datasets = {"mtbench": PROMPTS, "humaneval": [[8] * n for n in (1, 2, 3)]}
    ar_outputs = {}
    with open(tmp_path / "bench_raw.jsonl", "a") as raw:
        bench_vllm.run_method(raw, "vllm_ar", lambda: FakeLLM(clock, 100.0), datasets, [1, 2], "greedy", False,
                              ar_outputs)
        bench_vllm.run_method(raw, "vllm_dflash:d", lambda: FakeLLM(clock, 250.0, True, differ=[[7] * 4],
                                                                    fail=[[8] * 3]), datasets, [1, 2], "greedy",
                              True, ar_outputs)

        def broken():
            raise RuntimeError("no CUDA device")

        bench_vllm.run_method(raw, "vllm_dflash:x", broken, datasets, [1, 2], "greedy", True, ar_outputs)
    rows = [json.loads(line) for line in (tmp_path / "bench_raw.jsonl").read_text().splitlines()]
    by = {(r["method"], r["dataset"]): r for r in rows}
    assert len(rows) == 12 and [r["method"] for r in rows[:4]] == ["vllm_ar@1", "vllm_ar@2"] * 2
    ok = by[("vllm_dflash:d@2", "mtbench")]
    assert ok["same_as_ar"] == pytest.approx(0.8) and ok["tau"] == pytest.approx(2.5) and "error" not in ok
    # humaneval's third prompt fails in a timed chunk at both b: those rows carry the error, mtbench's were measured
    assert [by[("vllm_dflash:d@" + b, "humaneval")]["error"] for b in "12"] == ["ValueError('boom')"] * 2
    assert by[("vllm_dflash:d@1", "humaneval")]["tok_per_s"] is None
    assert "error" not in by[("vllm_dflash:d@1", "mtbench")]
    assert all("startup: RuntimeError('no CUDA device')" == by[(f"vllm_dflash:x@{b}", d)]["error"]
               for b in (1, 2) for d in datasets)
    assert {tuple(sorted(r)) for r in rows if "error" not in r and r["method"].startswith("vllm_ar")} == {
        ("batch", "dataset", "method", "prompts", "seconds", "tau", "tok_per_s", "tokens")}
    table = bench_table([tmp_path / "bench_raw.jsonl"])
    # vllm_dflash:d@2 on mtbench: 250 vs 100 tok/s -> 2.50 against its own AR and against vllm_ar@2
    assert "| mtbench | 0 | vllm_dflash:d@2 | 5 | 250.0 | 2.500 | – | – | – | 2.50 | 2.50 |" in table
    assert "| humaneval | 0 | vllm_dflash:x@1 | 3 | error: startup: RuntimeError('no CUDA device') | – |" in table



def test_bench_table_ratios_only_within_one_prompt_set(tmp_path):
    """A 3-prompt HF run and a 10-prompt vLLM run of one dataset are different workloads: no cross ratios."""
    rows = [{"method": "hf_eager", "dataset": "d", "prompts": 3, "tok_per_s": 20.0},
            {"method": "engine_ar@1", "dataset": "d", "prompts": 3, "tok_per_s": 200.0},
            {"method": "engine_ar@1", "dataset": "d", "prompts": 10, "tok_per_s": 250.0},
            {"method": "vllm_ar@1", "dataset": "d", "prompts": 10, "tok_per_s": 500.0}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = bench_table([tmp_path / "b.jsonl"]).splitlines()
    assert table[3] == "| d | 0 | engine_ar@1 | 3 | 200.0 | – | – | 10.00 | 1.00 | – | – |"
    assert table[4] == "| d | 0 | engine_ar@1 | 10 | 250.0 | – | – | – | 1.00 | – | 0.50 |"


def test_bench_table_ratios_only_within_one_temperature(tmp_path):
    """A sampled row is not compared with a greedy baseline (rows without a temperature are greedy)."""
    rows = [{"method": "engine_ar@1", "dataset": "d", "prompts": 3, "tok_per_s": 100.0},
            {"method": "engine_ar@1", "dataset": "d", "prompts": 3, "tok_per_s": 80.0, "temperature": 1.0},
            {"method": "engine:x@1", "dataset": "d", "prompts": 3, "tok_per_s": 120.0, "temperature": 1.0}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = bench_table([tmp_path / "b.jsonl"]).splitlines()
    assert table[4] == "| d | 1 | engine:x@1 | 3 | 120.0 | – | – | – | 1.50 | 1.50 | – |"

FAKE_VLLM = '''"""A stand-in `vllm` package: records LLM(...) arguments, echoes the first prompt token, counts fake
drafts."""
import json, os
from types import SimpleNamespace as NS

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, **kw):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps(kw) + "\\n")
        if kw["speculative_config"] and "broken" in kw["speculative_config"].get("model", ""):
            raise RuntimeError("cannot load drafter")
        self.requests = 0

    def generate(self, prompts, params, use_tqdm=True):
        self.requests += len(prompts)
        return [NS(outputs=[NS(token_ids=p["prompt_token_ids"][:1] * params.kw["max_tokens"])]) for p in prompts]

    def get_metrics(self):
        return [NS(name="vllm:spec_decode_num_drafts", value=2 * self.requests),
                NS(name="vllm:spec_decode_num_accepted_tokens", value=3 * self.requests)]
'''


def test_main_with_a_stand_in_vllm(tmp_path):
    """The script end to end against a fake `vllm` package: the LLM arguments, prompts and rows it produces."""
    import os
    import subprocess

    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for ds, n in (("mtbench", 3), ("humaneval", 20)):
        (prompts / f"{ds}.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": [5 + i] * (n + i)}) + "\n"
                                                     for i in range(4)))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "FAKE_VLLM_LOG": str(tmp_path / "llm.jsonl")}
    cmd = [sys.executable, str(ROOT / "examples" / "bench_vllm.py"), "--target", "T", "--drafter_export",
           "good=/x/d1", "/x/broken", "--prompts_dir", str(prompts), "--limit", "3", "--max_new_tokens", "4",
           "--batch_sizes", "1", "2", "--num_speculative_tokens", "3", "--ngram", "5",
           "--llm_kwargs", '{"enforce_eager": true}', "--out", str(tmp_path / "out")]
    subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=tmp_path)
    calls = [json.loads(line) for line in (tmp_path / "llm.jsonl").read_text().splitlines()]
    assert [c["speculative_config"] for c in calls] == [
        None, {"method": "dflash", "model": "/x/d1", "num_speculative_tokens": 3},
        {"method": "dflash", "model": "/x/broken", "num_speculative_tokens": 3},
        {"method": "ngram_gpu", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 3}]
    assert {k: calls[0][k] for k in ("model", "dtype", "enable_prefix_caching", "disable_log_stats", "max_num_seqs",
                                     "max_model_len", "enforce_eager")} == {
        "model": "T", "dtype": "bfloat16", "enable_prefix_caching": False, "disable_log_stats": False,
        "max_num_seqs": 2, "max_model_len": 22 + 4 + 5 + 16, "enforce_eager": True}  # longest prompt: 22; k=5
    rows = [json.loads(line) for line in (tmp_path / "out" / "bench_raw.jsonl").read_text().splitlines()]
    by = {(r["method"], r["dataset"]): r for r in rows}
    assert len(rows) == 16 and all(r["prompts"] == 3 for r in rows)
    ngram = by[("vllm_ngram_gpu@1", "humaneval")]
    assert ngram["num_speculative_tokens"] == 5 and ngram["same_as_ar"] == 1.0 and ngram["tau"] == pytest.approx(2.5)
    assert by[("vllm_ar@2", "humaneval")]["tokens"] == 12 and by[("vllm_ar@2", "humaneval")]["tau"] is None
    good = by[("vllm_dflash:good@2", "mtbench")]
    assert good["tau"] == pytest.approx(2.5) and good["same_as_ar"] == 1.0 and good["num_speculative_tokens"] == 3
    assert by[("vllm_dflash:broken@1", "mtbench")]["error"] == "startup: RuntimeError('cannot load drafter')"
    (tmp_path / "d16").mkdir()
    (tmp_path / "d16" / "config.json").write_text(json.dumps({"block_size": 16}))
    cmd[cmd.index("/x/broken")] = str(tmp_path / "d16")  # k=3 against a block of 16: refused before any LLM starts
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode != 0 and "block_size 16 proposes 15" in res.stderr
    summary = json.loads((tmp_path / "out" / "bench_vllm.json").read_text())
    assert summary["environment"]["vllm"] == "0.0-fake" and summary["methods"]["vllm_dflash:good"] == "/x/d1"
