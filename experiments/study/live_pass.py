"""The live pass: ``qlab live`` against a resident server, on vLLM where it is installed, each run
compared with the simulator request by request and predicted from its arrivals alone."""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Iterator

import pandas as pd

from .blocks import Figure, Table, Text, Verdict, not_run
from .live_checks import CAUSE_COLUMNS, prediction, prediction_verdict, rule_verdict
from .section import Context, Section, read_json, skippable


def live_data(ctx: Context) -> dict:
    """The live experiment as a ``qlab live`` TOML document: short, on vLLM where it is installed
    (the vLLM issue's reference engine; ``--live-engine``), else on the synthetic engine (GPT-2 on
    CUDA). vLLM's server is started for the run (:func:`_run`): the document says its shape and
    package (the inputs' digest), not its port."""
    server = {
        "engine": "synthetic",
        "policies": list(ctx.scale.live_policies),
        "startup_timeout_s": 180,
    }
    data = {"probe": {"requests": 3}}
    if _engine(ctx) == "vllm":
        from live import vllm_server

        server.update(
            engine="upstream", batching=True, max_num_seqs=vllm_server.ServerSpec.max_num_seqs
        )
        data["calibrate"] = {"rounds": 1, "per_size": 4}
        data["vllm"] = {"package": vllm_server.PACKAGE, "shape": VLLM_SHAPE}
    elif _cuda():
        server.update(engine="gpt2", model="random", device="cuda")
        data["calibrate"] = {"rounds": 1, "per_size": 4}
    data["server"] = server
    data["trace"] = [
        {
            "name": "poisson",
            "arrivals": "poisson",
            "nominal_load": list(ctx.scale.live_loads),
            "seconds": ctx.scale.live_seconds,
            "seed": 1,
        },
        {"name": "burst30", "arrivals": "burst:30", "seed": 1},
    ]
    return data


#: The local model vLLM serves in the study (live.vllm_server: tiny, 4 layers x 256).
VLLM_SHAPE = "tiny"
#: ``--live-engine``: auto takes vLLM where its venv has it (live.vllm_server.installed), else the
#: synthetic engine.
LIVE_ENGINES = ("auto", "vllm", "synthetic")


def _engine(ctx: Context) -> str:
    if ctx.live_engine != "auto":
        return ctx.live_engine
    return "vllm" if _vllm_installed() else "synthetic"


@functools.lru_cache(maxsize=1)
def _vllm_installed() -> bool:
    from live import vllm_server

    return vllm_server.installed()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _inputs(ctx: Context) -> dict:
    return skippable("live", lambda c: {"live": live_data(c)})(ctx)


def _run(ctx: Context, folder: Path) -> None:
    from live import live_config

    from .. import live_runner

    data = live_data(ctx)
    with _vllm_for(data, folder, ctx):
        cfg = live_config.parse(data, str(folder / "live.toml"))
        live_runner.run(cfg, folder / "live", log=lambda line: ctx.log(f"  live: {line}"))


@contextlib.contextmanager
def _vllm_for(data: dict, folder: Path, ctx: Context) -> Iterator[None]:
    """Where the live document says vLLM (its ``vllm`` key, taken out), a vLLM server for the block,
    its URL the server's upstream; otherwise nothing."""
    said = data.pop("vllm", None)
    if said is None:
        yield
        return
    from live import vllm_server

    python = vllm_server.install()
    spec = vllm_server.ServerSpec(vllm_server.model(python, said["shape"]))
    ctx.log(f"  live: starting vLLM ({spec.model.name}; 1-3 minutes)")
    with vllm_server.serving(spec, folder / "vllm.log", python) as url:
        data["server"]["upstream_url"] = url
        yield


def _report(ctx: Context, folder: Path) -> list:
    path = folder / "live" / "summary.parquet"
    if not path.is_file():
        return not_run(folder)
    from analysis import compare

    summary = pd.read_parquet(path)
    judged = (summary["requests"] - summary["error"]).sum()
    share = summary["sim_disagreements"].sum() / judged if judged else math.nan
    inputs = (read_json(folder / "inputs.json") or {}).get("inputs", {}).get("live", {})
    engine = inputs.get("server", {}).get("engine", "synthetic")
    if "vllm" in inputs:  # the reference engine: vLLM itself behind a batching upstream gate
        engine = (
            f"vLLM ({inputs['vllm']['package']}, GPT-2 {inputs['vllm']['shape']} shape with "
            "random weights; "
            "the gate an upstream batching one) as the"
        )
    cols = [
        "trace",
        "policy",
        "nominal_load",
        "effective_load",
        "requests",
        "good",
        "late",
        "rejected",
        "expired",
        "error",
        "goodput_rps",
        "sim_disagreements",
        "sim_disagreement_rate",
        *CAUSE_COLUMNS,
    ]
    # a summary from before the causes were counted lacks them
    cols = [c for c in cols if c in summary.columns]
    blocks = [
        Text(
            f"Each trace under each policy against a resident `qlab serve` ({engine} engine), "
            "order rotated, a speed "
            "probe before and after each run; then each run replayed in the simulator with what "
            "the gate knew, "
            "request by request (`qlab compare`), and predicted from its arrivals and the "
            "calibrated model alone "
            f"(`qlab compare --predict`, {ctx.scale.predict_seeds} seeds of the model's noise)."
        ),
        Verdict(
            "check",
            "the simulator and the service agree request by request",
            None if not judged else bool(share <= 0.05),
            f"{int(summary['sim_disagreements'].sum())} of {int(judged)} requests disagree "
            f"({share:.1%}; the "
            "reference study found about 1.6 %; judged against 5 %)",
        ),
        *rule_verdict(summary.to_dict("records")),
    ]
    keys = list(zip(summary["trace"], summary["policy"]))
    runs = {
        key: pd.read_parquet(folder / "live" / "runs" / f"{key[0]}__{key[1]}.parquet")
        for key in keys
    }
    predicted = pd.DataFrame([prediction(runs[key], ctx.scale.predict_seeds) for key in keys])
    blocks += [
        prediction_verdict(predicted.to_dict("records"), ctx.scale.predict_seeds),
        Table(
            pd.concat([summary[cols].reset_index(drop=True), predicted], axis=1),
            "live runs: their per-request disagreement with the simulator, and the "
            "model-only prediction's "
            "relative error (simulated mean minus live, over live)",
        ),
    ]
    for _, row in summary[summary["trace"] != "burst30"].iterrows():
        run = runs[(row["trace"], row["policy"])]
        png = folder / f"compare-{row['trace']}__{row['policy']}.png"
        compare.figure(compare.compare(run), png)
        blocks.append(
            Figure(
                png.stem,
                png.read_bytes(),
                "simulator against service, "
                f"{row['policy']} at nominal load "
                f"{row['nominal_load']:g}",
            )
        )
    return blocks


SECTION = Section(
    "live", "A live pass and the simulator against the service", _inputs, _run, _report
)
