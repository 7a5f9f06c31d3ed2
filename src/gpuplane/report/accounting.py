"""The accounting bill: the ledger's bookings over a period as CSV files and one HTML page with plots.

`write_bill` writes into a folder:

- `bill.csv`: GPU-hours allocated, used, idle-allocated and unmeasured, and the cost, per namespace, team, queue,
  card model and priority class;
- `monthly.csv`: the monthly bill per team (calendar months, UTC; an interval across a month's end is split);
- `low-efficiency.csv`: jobs and dev boxes whose cards sat allocated but idle (`low_efficiency`);
- `accounting.html`: the same tables and plots (used and idle GPU-hours per team, cost per team by card model,
  efficiency per priority class).

Ledger times are seconds since an epoch: `epoch` is its Unix time (0 for a live ledger, which books Unix seconds;
the start date for a simulation, whose clock starts at 0). The cost is allocated GPU-hours × the card model's
price per card-hour (`gpuplane/data/gpu-prices.yaml`, assumptions, or `--prices FILE`).
"""

from __future__ import annotations

import csv
import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml
from pydantic import BaseModel, Field

from gpuplane.controllers.accounting import KEYS, BillRow, Booking, LowEfficiency, bill, clip, low_efficiency
from gpuplane.model import GpuplaneError
from gpuplane.model.priority import BATCH_LOW, DEV, TRAINING
from gpuplane.model.yamlfile import validate_model
from gpuplane.report.html import comparison_table, image, page, png

BUNDLED_PRICES = "gpu-prices.yaml"
GOVERNED = frozenset({TRAINING, BATCH_LOW, DEV})
"""The classes the low-efficiency report looks at: jobs and dev boxes (serving replicas are the scalers')."""


class PriceError(GpuplaneError):
    """A price table that cannot be read."""


class PriceTable(BaseModel):
    """List prices per card-hour by card model."""

    currency: str = "USD"
    per_card_hour: dict[str, float] = Field(default_factory=dict)


def load_prices(path: Path | None = None) -> PriceTable:
    """The price table in `path` (None: the bundled `gpuplane/data/gpu-prices.yaml`)."""
    source = path if path is not None else Path(str(resources.files("gpuplane.data").joinpath(BUNDLED_PRICES)))
    try:
        raw = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise PriceError(f"{source}: {exc}") from None
    table = validate_model(raw, PriceTable, PriceError, str(source))
    negative = sorted(m for m, p in table.per_card_hour.items() if p < 0)
    if negative:
        raise PriceError(f"{source}: per_card_hour: negative price for {', '.join(negative)}")
    return table


def month_of(t: float, epoch: float) -> str:
    return datetime.fromtimestamp(t + epoch, UTC).strftime("%Y-%m")


def split_by_month(bookings: Iterable[Booking], epoch: float) -> list[tuple[str, Booking]]:
    """Each booking as (month, part), cut at calendar months' ends (UTC)."""
    out: list[tuple[str, Booking]] = []
    for b in bookings:
        start = b.start
        while start < b.end:
            moment = datetime.fromtimestamp(start + epoch, UTC)
            following = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=UTC)
            cut = min(b.end, following.timestamp() - epoch)
            part = b.clipped(start, cut)
            if part is not None:
                out.append((moment.strftime("%Y-%m"), part))
            start = cut
    return out


@dataclass(frozen=True, slots=True)
class Bill:
    """What `write_bill` wrote and the totals it drew."""

    rows: tuple[BillRow, ...]
    monthly: tuple[BillRow, ...]
    """key: (month, team)"""
    low: tuple[LowEfficiency, ...]
    missing_prices: tuple[str, ...]
    currency: str
    paths: tuple[Path, ...]

    @property
    def totals(self) -> BillRow:
        return BillRow(("total",), *(sum(getattr(r, f) for r in self.rows) for f in (
            "allocated_gpu_s", "used_gpu_s", "idle_gpu_s", "unmeasured_gpu_s", "cost")))


def _h(seconds: float) -> str:
    return f"{seconds / 3600.0:.3f}"


def _pct(row: BillRow | LowEfficiency) -> str:
    return f"{100.0 * row.efficiency:.1f}" if row.allocated_gpu_s > 0 else ""


FIGURES = ("allocated_gpu_h", "used_gpu_h", "idle_gpu_h", "unmeasured_gpu_h", "efficiency_pct")


def _figures(row: BillRow) -> list[str]:
    return [_h(row.allocated_gpu_s), _h(row.used_gpu_s), _h(row.idle_gpu_s), _h(row.unmeasured_gpu_s), _pct(row)]


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _plots(rows: Sequence[BillRow], prices: Mapping[str, float], bookings: Sequence[Booking]) -> list[tuple[str, str]]:
    teams = bill(bookings, prices, by=("team",))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r.key[0] for r in teams]
    used = [r.used_gpu_s / 3600 for r in teams]
    idle = [r.idle_gpu_s / 3600 for r in teams]
    ax.bar(names, used, label="used", color="#2b8cbe")
    ax.bar(names, idle, bottom=used, label="idle-allocated", color="#fdae6b")
    ax.set_ylabel("GPU-hours")
    ax.set_title("GPU-hours allocated per team: used and idle")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    plots = [("GPU-hours per team, used and idle", png(fig))]
    plt.close(fig)

    by_model = bill(bookings, prices, by=("team", "card_model"))
    models = sorted({r.key[1] for r in by_model})
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bottom = [0.0] * len(names)
    for model in models:
        values = [next((r.cost for r in by_model if r.key == (team, model)), 0.0) for team in names]
        ax.bar(names, values, bottom=bottom, label=model)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.set_ylabel("cost")
    ax.set_ylim(0, max(bottom, default=0.0) * 1.08 or 1.0)
    ax.set_title("Cost per team, by card model")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    plots.append(("cost per team by card model", png(fig)))
    plt.close(fig)

    classes = bill(bookings, prices, by=("priority_class",))
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar([r.key[0] or "(none)" for r in classes], [100.0 * r.efficiency for r in classes], color="#31a354")
    ax.set_ylabel("used / allocated (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Efficiency per priority class")
    fig.tight_layout()
    plots.append(("efficiency per priority class", png(fig)))
    plt.close(fig)
    return plots


def write_bill(bookings: Iterable[Booking], prices: PriceTable, start: float, end: float, out: Path, *,
               epoch: float = 0.0, title: str = "GPU accounting", source: str = "", max_efficiency: float = 0.3,
               min_gpu_s: float = 3600.0) -> Bill:
    """The bill of `bookings` within [start, end) of ledger time (see the module docstring)."""
    if end <= start:
        raise ValueError(f"the period is empty: from {start} to {end}")
    out.mkdir(parents=True, exist_ok=True)
    table = prices.per_card_hour
    parts = clip(bookings, start, end)
    rows = tuple(bill(parts, table))
    monthly_parts = split_by_month(parts, epoch)
    months = {id(b): m for m, b in monthly_parts}
    monthly = tuple(bill((b for _, b in monthly_parts), table, key=lambda b: (months[id(b)], b.team)))
    low = tuple(low_efficiency(parts, table, max_efficiency=max_efficiency, min_gpu_s=min_gpu_s, classes=GOVERNED))
    missing = tuple(sorted({b.card_model for b in parts if b.card_model not in table}))
    cur = prices.currency
    paths = [
        _write_csv(out / "bill.csv", (*KEYS, *FIGURES, f"cost_{cur}"),
                   ([*r.key, *_figures(r), f"{r.cost:.2f}"] for r in rows)),
        _write_csv(out / "monthly.csv", ("month", "team", *FIGURES, f"cost_{cur}"),
                   ([*r.key, *_figures(r), f"{r.cost:.2f}"] for r in monthly)),
        _write_csv(out / "low-efficiency.csv", ("pod", "team", "priority_class", "card_model", "allocated_gpu_h",
                                                "used_gpu_h", "efficiency_pct", f"cost_{cur}"),
                   ([r.pod, r.team, r.priority_class, r.card_model, _h(r.allocated_gpu_s), _h(r.used_gpu_s),
                     _pct(r), f"{r.cost:.2f}"] for r in low)),
    ]
    result = Bill(rows, monthly, low, missing, cur, ())
    totals = result.totals
    period = (f"{datetime.fromtimestamp(start + epoch, UTC):%Y-%m-%d %H:%M} to "
              f"{datetime.fromtimestamp(end + epoch, UTC):%Y-%m-%d %H:%M} UTC")
    team_rows = bill(parts, table, by=("team",))
    body = [f"<p>{html.escape(source)} Period {html.escape(period)}. Prices per card-hour are assumptions "
            f"({html.escape(', '.join(f'{m} {p:g}' for m, p in sorted(table.items())))} {html.escape(cur)}).</p>"]
    if missing:
        body.append(f"<p><strong>No price for:</strong> {html.escape(', '.join(missing))} (billed 0).</p>")
    body.append("<h2>Totals per team</h2>" + comparison_table(
        ("allocated GPU-h", "used GPU-h", "idle GPU-h", "unmeasured GPU-h", "efficiency %", f"cost {cur}"),
        [(r.key[0], *_figures(r), f"{r.cost:.2f}") for r in [*team_rows, totals]]))
    body.extend(image(alt, data) for alt, data in _plots(rows, table, parts))
    body.append("<h2>Monthly bills per team</h2>" + comparison_table(
        ("team", "allocated GPU-h", "used GPU-h", "idle GPU-h", "unmeasured GPU-h", "efficiency %", f"cost {cur}"),
        [(r.key[0], r.key[1], *_figures(r), f"{r.cost:.2f}") for r in monthly]))
    body.append("<h2>By namespace, team, queue, card model and priority class</h2>" + comparison_table(
        ("team", "queue", "card model", "priority class", "allocated GPU-h", "used GPU-h", "idle GPU-h",
         "unmeasured GPU-h", "efficiency %", f"cost {cur}"),
        [(*r.key, *_figures(r), f"{r.cost:.2f}") for r in rows]))
    body.append(f"<h2>Low efficiency (at most {100 * max_efficiency:.0f} % used, at least "
                f"{min_gpu_s / 3600:g} GPU-h held)</h2>" + (comparison_table(
                    ("team", "class", "card model", "allocated GPU-h", "used GPU-h", "efficiency %", f"cost {cur}"),
                    [(r.pod, r.team, r.priority_class, r.card_model, _h(r.allocated_gpu_s), _h(r.used_gpu_s),
                      _pct(r), f"{r.cost:.2f}") for r in low]) if low else "<p>None.</p>"))
    page_path = out / "accounting.html"
    page_path.write_text(page(title, "\n".join(body)), encoding="utf-8")
    paths.append(page_path)
    return Bill(rows, monthly, low, missing, cur, tuple(paths))
