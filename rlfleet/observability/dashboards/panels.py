"""The panel kinds the rlfleet dashboards use, built with Grafana's foundation SDK, and their layout."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# (PromQL, legend) of one query of a panel.
Target = tuple[str, str]
# A field override: series whose name matches `regex` get `properties` (Grafana property id -> value).
Override = tuple[str, dict[str, Any]]
# Threshold steps: (value, colour), the first value None (the base).
Steps = Sequence[tuple[float | None, str]]

DASHED = {"dash": [10, 10], "fill": "dash"}


def fixed_color(color: str) -> dict[str, str]:
    return {"fixedColor": color, "mode": "fixed"}


def _targets(panel: Any, targets: Sequence[Target], *, instant: bool = False) -> None:
    for ref, (expr, legend) in zip("ABCDEFGH", targets, strict=False):
        query = prometheus.Dataquery().ref_id(ref).datasource(DATASOURCE).expr(expr).legend_format(legend)
        panel.with_target(query.instant() if instant else query)


def _thresholds(steps: Steps) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=value, color=color) for value, color in steps])


def _common(panel: Any, title: str, description: str, *, unit: str | None, decimals: int | None,
            min_val: float | None, thresholds: Steps | None, overrides: Sequence[Override]) -> None:
    panel.title(title).description(description).datasource(DATASOURCE)
    if unit is not None:
        panel.unit(unit)
    if decimals is not None:
        panel.decimals(decimals)
    if min_val is not None:
        panel.min(min_val)
    if thresholds is not None:
        panel.thresholds(_thresholds(thresholds))
    for regex, properties in overrides:
        panel.override_by_regexp(regex, [dm.DynamicConfigValue(id_val=k, value=v) for k, v in properties.items()])


def time_series(title: str, description: str, *targets: Target, unit: str | None = None,
                decimals: int | None = None, min_val: float | None = None, bars: bool = False,
                steps_after: bool = False, thresholds: Steps | None = None, threshold_style: str | None = None,
                overrides: Sequence[Override] = ()) -> timeseries.Panel:
    """A time series; `bars`: stacked bars (counts per interval); `steps_after`: a value that holds until it
    changes, with its points drawn; `threshold_style`: draw the thresholds ("line", "line+area")."""
    panel = timeseries.Panel()
    _common(panel, title, description, unit=unit, decimals=decimals, min_val=min_val, thresholds=thresholds,
            overrides=overrides)
    _targets(panel, targets)
    if bars:
        panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80).stacking(
            cb.StackingConfig().mode(cm.StackingMode.NORMAL).group("A"))
    if steps_after:
        panel.draw_style(cm.GraphDrawStyle.LINE).line_interpolation(cm.LineInterpolation.STEP_AFTER).show_points(
            cm.VisibilityMode.ALWAYS)
    if threshold_style is not None:
        panel.thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode(threshold_style)))
    panel.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(
        cm.LegendPlacement.BOTTOM).show_legend(True))
    panel.tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    return panel


def stat_value(title: str, description: str, *targets: Target, unit: str | None = None,
               decimals: int | None = None, thresholds: Steps | None = None) -> stat.Panel:
    """The last value of each series, big, with a sparkline."""
    panel = stat.Panel()
    _common(panel, title, description, unit=unit, decimals=decimals, min_val=None, thresholds=thresholds,
            overrides=())
    _targets(panel, targets, instant=True)
    panel.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
    panel.color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.AREA).text_mode(
        cm.BigValueTextMode.AUTO)
    return panel


def state_timeline(title: str, description: str, target: Target,
                   states: Sequence[tuple[str, str]]) -> statetimeline.Panel:
    """A band per series whose value 1..n names one of `states` ((text, colour) each)."""
    panel = statetimeline.Panel()
    _common(panel, title, description, unit=None, decimals=None, min_val=None, thresholds=[(None, "green")],
            overrides=())
    _targets(panel, [target])
    panel.mappings([dm.ValueMap(options={
        str(i + 1): dm.ValueMappingResult(text=text, color=color, index=i) for i, (text, color) in enumerate(states)})])
    panel.color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
    panel.fill_opacity(80).line_width(0)
    panel.show_value(cm.VisibilityMode.NEVER).merge_values(True).row_height(0.9).align_value(
        cm.TimelineValueAlignment.LEFT)
    panel.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(
        cm.LegendPlacement.BOTTOM).show_legend(False))
    return panel


@dataclass(frozen=True)
class Cell:
    """A panel and its size in grid units (24 wide)."""

    panel: Builder[Any]
    w: int
    h: int = 8


def layout(board: db.Dashboard, rows: Sequence[tuple[str, Sequence[Cell]]]) -> db.Dashboard:
    """Each row's title bar, then its panels left to right, wrapping at the grid's 24 columns; ids in order."""
    y = 0
    next_id = 1
    for title, cells in rows:
        board.with_row(db.Row(title).id(next_id).grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
        next_id += 1
        y += 1
        x = 0
        line_h = 0
        for cell in cells:
            if x + cell.w > 24:
                x, y, line_h = 0, y + line_h, 0
            cell.panel.id(next_id).grid_pos(dm.GridPos(h=cell.h, w=cell.w, x=x, y=y))  # type: ignore[attr-defined]
            board.with_panel(cell.panel)
            next_id += 1
            x += cell.w
            line_h = max(line_h, cell.h)
        y += line_h
    return board


def dashboard(uid: str, title: str, description: str, variable: str, label: str, values_of: str) -> db.Dashboard:
    """A dashboard with the `datasource` variable and one multi-value filter `variable` (label_values)."""
    return (
        db.Dashboard(title).uid(uid).description(description).tags(["rlfleet"]).editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-6h", "now").timezone("browser")
        .link(db.DashboardLink("rlfleet").type(dm.DashboardLinkType.DASHBOARDS).tags(["rlfleet"])
              .as_dropdown(False).include_vars(True).keep_time(True))
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(db.QueryVariable(variable).label(label).datasource(DATASOURCE)
                       .query(f"label_values({values_of}, {variable})")
                       .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True)
                       .all_value(".*").sort(dm.VariableSort.ALPHABETICAL_ASC))
    )
