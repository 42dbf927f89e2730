"""``megakernels plan --reproduce FILE``: published training runs through the step-time model.

Each row of FILE (CSV, a header line; extra columns are ignored) is one published run: the model, the machine, the
layout and the one figure the publication gives (``published_metric``, ``published_value``). The run goes through
``costs.predict`` at that layout and the same figure is computed from the predicted step time, so the two can be
compared: ``rel_error = predicted / published − 1``.

Columns — required: ``model`` (gpt | llama), ``num_layers, hidden, heads, vocab, seq_len, gpu`` (a ``costs.DEVICES``
key: h200, h100, a100, v100), ``num_gpus, tp, pp, global_batch, published_metric, published_value``; optional:
``num_kv_heads, ffn_hidden, vpp, cp, dp, micro_batch, gpus_per_node, precision`` (bf16 | fp16 | fp8: the blocks'
linears in FP8 as ``costs.py`` models them; refused on a GPU without FP8), ``fp8_recipe`` (tensorwise | blockwise,
with fp8), ``recompute`` (none | selective | full), ``sequence_parallel, distributed_optimizer, fsdp`` (true/false, 1/0,
yes/no), ``flash_attention`` (true/false: whether attention keeps its scores out of memory, as FlashAttention does;
default true; false for runs before it, whose scores go through memory-bound softmax kernels), ``source``. An
empty optional cell takes the default: num_kv_heads = heads, ffn_hidden the family's, vpp 1, cp 1,
dp = num_gpus / (tp·pp·cp), gpus_per_node the GPU's system (``Device.gpus_per_node``), precision bf16, fp8_recipe
tensorwise, recompute none, the flags false. ``micro_batch`` empty or ``auto`` (publications often leave it out),
and ``vpp`` ``auto``: the value the planner would choose — the fastest predicted of those the layout rules accept
and that fit the GPU's memory (micro-batches of at most 16 samples dividing the per-replica batch; every chunk count
dividing a stage's layers); the chosen values are reported with the row.

Metrics (``METRICS``), from the predicted step time ``t`` on ``n = num_gpus`` GPUs of a global batch of ``B``
sequences of ``s`` tokens:

- ``iteration_s``: ``t``;
- ``tokens_per_s_per_gpu``: ``B·s / (t·n)``;
- ``tflops_per_gpu``: ``F / (t·n) / 1e12`` with ``F = B·s·ModelConfig.flops_per_token(recompute)``, the FLOPs the
  GPUs execute, recomputation included. For GPT this is exactly Narayanan et al. 2021's eq. (3),
  ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` with full recomputation (``72·…·(1 + s/6h + V/12lh)`` without), the count
  Megatron-LM's papers report;
- ``mfu``: ``B·s·flops_per_token("none") / (t·n) / peak``, the model FLOPs (no recomputation) against the GPU's
  dense 16-bit peak (``Device.tflops_16``); published as a fraction (0.43), a percentage (43) or with a sign (43%).

A row the command cannot reproduce — a bad cell (a ``vpp`` of ``n/a``, a word where a number goes), a published
layout that does not hold (a global batch that does not split over its data-parallel replicas, GPUs that are no
multiple of tp·pp·cp), a model that cannot be built — is listed with its reason, which names the file, the row (1 =
the first after the header), the line and the column, and the other rows are reproduced (as ``megakernels bench
--static --peer-csv`` lists the rows it cannot model); the command exits with status 1 when no row could be
reproduced. A file that cannot be read, a header without a required column or a file without rows is one error:
status 2, no traceback.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import statistics

from megakernels.parallel.layout import LayoutError, ParallelLayout
from megakernels.precisions import HALF
from megakernels_models.models.config import RECOMPUTE, ModelConfig
from megakernels_models.planning import costs

REQUIRED = (
    "model",
    "num_layers",
    "hidden",
    "heads",
    "vocab",
    "seq_len",
    "gpu",
    "num_gpus",
    "tp",
    "pp",
    "global_batch",
    "published_metric",
    "published_value",
)
OPTIONAL = (
    "num_kv_heads",
    "ffn_hidden",
    "vpp",
    "cp",
    "dp",
    "micro_batch",
    "gpus_per_node",
    "precision",
    "fp8_recipe",
    "recompute",
    "sequence_parallel",
    "distributed_optimizer",
    "fsdp",
    "flash_attention",
    "source",
)
METRICS = ("tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "iteration_s")
MODELS = ("gpt", "llama")
PRECISIONS = (*HALF, "fp8")  # what published training tables report
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n", "")


class ReproduceError(ValueError):
    """A CSV the command cannot read (the message names the file, row, line and column)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: the model, the device, the layout (``micro_batch``/``vpp`` None: chosen by the planner)
    and the published figure; ``row``: the input's columns as read. ``timed``: the model whose step is timed —
    ``config`` itself, or, when ``pp`` does not divide the layers (uneven stages, as Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers`` and Llama 3's first and last stages with one layer fewer), ``pp``
    stages of the largest stage's layers: the largest stage sets the pipeline's pace. The metric counts ``config``'s
    FLOPs."""

    config: ModelConfig
    gpu: str
    num_gpus: int
    gpus_per_node: int
    layout: costs.Layout
    auto_micro_batch: bool
    auto_vpp: bool
    metric: str
    published: float
    row: dict
    timed: ModelConfig | None = None
    position: tuple[int, int] = (1, 2)  # (row, line) in its file

    @property
    def timed_config(self) -> ModelConfig:
        return self.timed or self.config


def _where(path: str, n: int, line: int, column: str | None = None) -> str:
    return f"{path}: row {n} (line {line})" + (f", column '{column}'" if column else "")


def device_key(name: str) -> str | None:
    """The ``costs.DEVICES`` key a GPU column names: the key itself, or a spelling of that SXM part ("H100 SXM5",
    "NVIDIA H100 80GB HBM3", "A100-SXM4-80GB"); None for another part (PCIe, NVL, the 40 GB A100: other peaks,
    clocks or memory than the table's) or an unknown GPU."""
    flat = re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia")
    if flat in costs.DEVICES:
        return flat
    if any(other in flat for other in ("pcie", "nvl", "40gb")):
        return None
    keys = [k for k in costs.DEVICES if flat.startswith(k)]
    return keys[0] if len(keys) == 1 else None


def parse_row(raw: dict, path: str = "<csv>", n: int = 1, line: int = 2) -> Run:
    """One CSV row (``{column: text}``) -> a ``Run``; ReproduceError naming the row and column on a bad cell."""
    cell = {k.strip().lower(): (v or "").strip() for k, v in raw.items() if k is not None}

    def fail(column: str, why: str):
        raise ReproduceError(f"{_where(path, n, line, column)}: {why}")

    def text(column: str, default: str | None = None) -> str:
        value = cell.get(column, "")
        if value == "":
            if default is None:
                fail(column, "missing (a required column)")
            return default
        return value

    def integer(column: str, default: int | None = None, minimum: int = 1) -> int:
        value = text(column, None if default is None else str(default))
        try:
            got = int(float(value)) if float(value).is_integer() else None
        except ValueError:
            got = None
        if got is None or got < minimum:
            fail(column, f"expected an integer >= {minimum}, got {value!r}")
        return got

    def choice(column: str, options: tuple, default: str | None = None) -> str:
        value = text(column, default).lower()
        if value not in options:
            fail(column, f"expected one of {', '.join(options)}, got {value!r}")
        return value

    def flag(column: str) -> bool:
        value = cell.get(column, "").lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        fail(column, f"expected true or false, got {cell.get(column)!r}")

    def auto_or_int(column: str, empty_is_auto: bool) -> int | None:
        value = cell.get(column, "").lower()
        if value == "auto" or (value == "" and empty_is_auto):
            return None
        if value and not re.fullmatch(r"[0-9.e+]+", value):
            empty = "the planner's choice" if empty_is_auto else "1"
            fail(column, f"expected an integer >= 1 or auto (empty: {empty}), got {cell.get(column)!r}")
        return integer(column, 1)

    model = choice("model", MODELS)
    gpu = device_key(text("gpu"))
    if gpu is None:
        fail("gpu", f"expected one of {', '.join(sorted(costs.DEVICES))} (SXM parts), got {text('gpu')!r}")
    device = costs.DEVICES[gpu]
    layers, hidden, heads = integer("num_layers"), integer("hidden"), integer("heads")
    vocab, seq = integer("vocab"), integer("seq_len")
    kv_heads = integer("num_kv_heads", heads)
    ffn = integer("ffn_hidden") if cell.get("ffn_hidden") else None
    num_gpus, tp, pp = integer("num_gpus"), integer("tp"), integer("pp")
    cp = integer("cp", 1)
    if num_gpus % (tp * pp * cp):
        fail("num_gpus", f"{num_gpus} GPUs are not a multiple of tp·pp·cp = {tp * pp * cp}")
    dp = integer("dp", num_gpus // (tp * pp * cp))
    if tp * pp * cp * dp != num_gpus:
        fail("dp", f"tp·pp·cp·dp = {tp * pp * cp * dp}, not num_gpus = {num_gpus}")
    batch = integer("global_batch")
    if batch % dp:
        fail("global_batch", f"{batch} sequences do not split over dp = {dp} replicas")
    micro = auto_or_int("micro_batch", empty_is_auto=True)
    if micro is not None and (batch // dp) % micro:
        fail("micro_batch", f"{micro} does not divide the {batch // dp} sequences of a data-parallel replica")
    vpp = auto_or_int("vpp", empty_is_auto=False)
    per_node = integer("gpus_per_node", device.gpus_per_node)
    precision = choice("precision", PRECISIONS, "bf16")
    if precision == "fp8" and not device.tflops_8:
        fail("precision", f"fp8 needs FP8 tensor cores, which the {device.name} (gpu {gpu}) does not have")
    recipe = choice("fp8_recipe", costs.FP8_RECIPES, "tensorwise")
    if recipe != "tensorwise" and precision != "fp8":
        fail("fp8_recipe", f"{recipe} scaling needs precision fp8, got {precision}")
    recompute = choice("recompute", RECOMPUTE, "none")
    sp, zero1, fsdp = flag("sequence_parallel"), flag("distributed_optimizer"), flag("fsdp")
    flash = flag("flash_attention") if cell.get("flash_attention", "") != "" else True
    metric = choice("published_metric", METRICS)
    value = text("published_value")
    try:
        published = float(value.removesuffix("%"))
    except ValueError:
        fail("published_value", f"expected a number, got {cell.get('published_value')!r}")
    if not published > 0 or math.isinf(published):
        fail("published_value", f"expected a positive number, got {cell.get('published_value')!r}")
    if metric == "mfu" and value.endswith("%"):
        published = float(value[:-1]) / 100
    elif metric == "mfu" and published > 1:  # a utilisation above 1 is a percentage (43 for 43 %)
        if published > 100:
            fail("published_value", f"an MFU of {value} is neither a fraction nor a percentage")
        published /= 100
    try:
        cfg = ModelConfig(
            model,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            seq_length=seq,
            vocab_size=vocab,
            ffn_hidden_size=ffn,
            attention_dropout=0.0 if cp > 1 else 0.1,  # ring attention has none
        )
    except (ValueError, TypeError) as e:
        fail("model", f"not a valid {model} model: {e}")
    # uneven pipeline stages: timed as pp stages of the largest one's layers (``Run``)
    timed = cfg if layers % pp == 0 else cfg.replace(num_layers=-(-layers // pp) * pp)
    try:
        rules = ParallelLayout.build(num_gpus, tp=tp, cp=cp, pp=pp, dp=dp, vpp=vpp if vpp and vpp > 1 else None)
        problem = rules.model_problem(timed.layout_shapes())
    except LayoutError as e:
        problem = str(e)
    if problem:
        named = [c for c in ("vpp", "cp", "tp", "pp") if c in problem.split()] or ["tp"]
        fail(named[0], f"the layout does not fit the model: {problem}")
    layout = costs.Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        vpp=vpp or 1,
        micro_batch_size=micro or 1,
        global_batch_size=batch,
        sequence_parallel=sp and tp > 1,
        distributed_optimizer=zero1 or fsdp,
        fsdp=fsdp,
        flash=flash,
        recompute=recompute,
        precision=precision,
        fp8_recipe=recipe,
        fused_linear_ce=False,  # the published runs hold the logits (Megatron-LM's head)
    )
    row = dict(cell)  # every input column, extra ones included (the report carries them; the model ignores them)
    return Run(
        cfg, gpu, num_gpus, per_node, layout, micro is None, vpp is None, metric, published, row, timed, (n, line)
    )


def read_rows(path: str) -> tuple[list[Run], list[dict]]:
    """The rows of a published-runs CSV: ``(runs, rejected)``, ``rejected`` the rows that cannot be read as runs,
    each ``{"csv", "row", "line", "reason"}`` (the reason names the file, row, line and column).

    Raises:
        ReproduceError: a missing file, a header without a required column, or no rows.
    """
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ReproduceError(f"{path}: cannot read: {e.strerror or e}") from None
    reader = csv.DictReader(line for line in text.splitlines() if line.strip() and not line.startswith("#"))
    header = [h.strip().lower() for h in (reader.fieldnames or [])]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ReproduceError(f"{path}: the header lacks the required column(s) {', '.join(missing)}")
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if line.strip() and not line.startswith("#")][1:]
    runs, rejected = [], []
    for n, raw in enumerate(reader, 1):
        try:
            runs.append(parse_row(raw, path, n, lines[n - 1]))
        except ReproduceError as e:
            rejected.append({"csv": path, "row": n, "line": lines[n - 1], "reason": str(e)})
    if not runs and not rejected:
        raise ReproduceError(f"{path}: no rows after the header")
    return runs, rejected


def read_csv(path: str) -> list[Run]:
    """Every row of a published-runs CSV, all of which must be runs.

    Raises:
        ReproduceError: a missing file, a missing column, no rows, or the first row that cannot be read
            (``read_rows``' reason).
    """
    runs, rejected = read_rows(path)
    if rejected:
        raise ReproduceError(rejected[0]["reason"])
    return runs


def metric_value(metric: str, step_s: float, cfg: ModelConfig, layout: costs.Layout, device: costs.Device) -> float:
    """``metric`` of a run whose optimizer step takes ``step_s`` (see the module docstring)."""
    tokens = layout.global_batch_size * cfg.seq_length
    n = layout.world
    if metric == "iteration_s":
        return step_s
    if metric == "tokens_per_s_per_gpu":
        return tokens / step_s / n
    if metric == "tflops_per_gpu":
        return cfg.flops_per_token(layout.recompute) * tokens / step_s / n / 1e12
    if metric == "mfu":
        return cfg.flops_per_token("none") * tokens / step_s / n / (device.tflops_16 * 1e12)
    raise ValueError(f"metric_value: unknown metric {metric!r} (one of {', '.join(METRICS)})")


def _choices(run: Run) -> list[costs.Layout]:
    L = run.layout
    per_replica = L.global_batch_size // L.dp
    micros = [m for m in range(1, min(16, per_replica) + 1) if per_replica % m == 0] if run.auto_micro_batch else []
    micros = micros or [L.micro_batch_size]
    chunks = run.timed_config.num_layers // L.pp
    vpps = [v for v in range(1, chunks + 1) if chunks % v == 0] if run.auto_vpp and L.pp > 1 else [L.vpp]
    out = []
    for m in micros:
        for v in vpps:
            if v > 1 and (per_replica // m) % L.pp:  # the interleaved schedule runs micro-batches in groups of pp
                continue
            out.append(dataclasses.replace(L, micro_batch_size=m, vpp=v))
    if not out:
        raise ValueError(
            f"vpp {L.vpp}: the interleaved schedule runs micro-batches in groups of pp = {L.pp}, and no micro_batch "
            f"({', '.join(map(str, micros))}) makes the {per_replica} sequences of a replica a multiple of {L.pp} "
            "micro-batches"
        )
    return out


def predict_run(run: Run, meta: costs.MetaModel | None = None) -> dict:
    """The run's prediction: ``{"layout", "prediction" (costs.predict's), "predicted" (the row's metric),
    "rel_error", "memory_bytes", "fits"}``; an ``auto`` micro-batch or vpp takes the fastest value that fits.

    Raises:
        ValueError: an interleaved layout (vpp > 1) with no micro-batch size that gives a multiple of pp
            micro-batches.
    """
    device = costs.DEVICES[run.gpu]
    meta = meta or costs.MetaModel(run.timed_config)
    best = None
    for layout in _choices(run):
        mem = costs.memory(meta, layout)["total"]
        pred = costs.predict(meta, layout, device, run.gpus_per_node)
        key = (not costs.fits(mem, device), pred["step_s"])
        if best is None or key < best[0]:
            best = (key, layout, pred, mem)
    _, layout, pred, mem = best
    predicted = metric_value(run.metric, pred["step_s"], run.config, layout, device)
    return {
        "layout": layout,
        "prediction": pred,
        "predicted": predicted,
        "rel_error": predicted / run.published - 1.0,
        "memory_bytes": mem,
        "fits": costs.fits(mem, device),
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(rel_errors: list[float]) -> dict:
    """``{"count", "median_abs_rel_error", "p90_abs_rel_error"}`` of the rows' relative errors."""
    errors = [abs(e) for e in rel_errors]
    return {
        "count": len(errors),
        "median_abs_rel_error": statistics.median(errors) if errors else float("nan"),
        "p90_abs_rel_error": percentile(errors, 90),
    }


def reproduce(*paths: str) -> dict:
    """The report of one or more CSVs: ``{"csv": [paths], "rows": [input columns + "csv" + the chosen layout +
    predicted, rel_error, ...], "not_reproduced": [{"csv", "row", "line", "reason"}], "summary"}`` (one summary over
    every reproduced row; the rows that cannot be read or predicted are listed with the reason, module docstring).

    Raises:
        ReproduceError: a file that cannot be read, lacks a required column or has no rows (``read_rows``).
    """
    runs, rejected = [], []
    for path in paths:
        got_runs, got_rejected = read_rows(path)
        runs += [(path, run) for run in got_runs]
        rejected += got_rejected
    metas: dict = {}
    rows = []
    for path, run in runs:
        try:
            meta = metas.get(run.timed_config) or metas.setdefault(run.timed_config, costs.MetaModel(run.timed_config))
            got = predict_run(run, meta)
        except ValueError as e:  # the model of the row's sizes cannot be built or priced (ArgumentError included)
            n, line = run.position
            rejected.append({"csv": path, "row": n, "line": line, "reason": f"{_where(path, n, line)}: {e}"})
            continue
        L, pred = got["layout"], got["prediction"]
        rows.append(
            {
                **run.row,
                "csv": path,
                "csv_row": run.position[0],
                "published_value": run.published,
                "predicted": got["predicted"],
                "rel_error": got["rel_error"],
                "layout": {
                    "dp": L.dp,
                    "micro_batch": L.micro_batch_size,
                    "vpp": L.vpp,
                    "microbatches": L.microbatches,
                    "stage_layers": run.timed_config.num_layers // L.pp,
                },
                "step_s": pred["step_s"],
                "time_split_s": {
                    k: pred[k] for k in ("compute_s", "bubble_s", "tp_s", "pp_s", "cp_s", "dp_s", "ep_s", "offload_s")
                },
                "memory_per_gpu_bytes": got["memory_bytes"],
                "fits": got["fits"],
            }
        )
    rejected.sort(key=lambda r: (paths.index(r["csv"]), r["row"]))
    return {
        "csv": list(paths),
        "rows": rows,
        "not_reproduced": rejected,
        "summary": summary([r["rel_error"] for r in rows]),
    }


def _fmt(metric: str, value: float) -> str:
    return f"{value:.1%}" if metric == "mfu" else f"{value:.4g}"


def print_report(report: dict) -> None:
    rows = report["rows"]
    print(f"{', '.join(report['csv'])}: {len(rows)} published runs through the step-time model")
    if not rows:
        _print_rejected(report)
        return
    print(
        f"{'#':>3} {'model':>5} {'l':>4} {'h':>6} {'gpu':>5} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'mbs':>3} "
        f"{'vpp':>3} {'metric':>21} {'published':>10} {'predicted':>10} {'error':>7}"
    )
    for r in rows:
        L = r["layout"]
        print(
            f"{r['csv_row']:>3} {r['model']:>5} {r['num_layers']:>4} {r['hidden']:>6} {r['gpu']:>5} {r['num_gpus']:>5} "
            f"{r['tp']:>3} {r['pp']:>3} {L['dp']:>4} {L['micro_batch']:>3} {L['vpp']:>3} "
            f"{r['published_metric']:>21} {_fmt(r['published_metric'], r['published_value']):>10} "
            f"{_fmt(r['published_metric'], r['predicted']):>10} {r['rel_error']:>+7.1%}"
        )
    s = report["summary"]
    print(
        f"\n{s['count']} runs: median |error| {s['median_abs_rel_error']:.1%}, "
        f"90th percentile {s['p90_abs_rel_error']:.1%}"
    )
    _print_rejected(report)


def _print_rejected(report: dict) -> None:
    rejected = report.get("not_reproduced", [])
    if rejected:
        print(f"{len(rejected)} row(s) not reproduced:")
        for r in rejected:
            print(f"  {r['reason']}")
