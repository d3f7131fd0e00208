"""The plan report: an epoch planned two ways, measured, as tables, JSON and plots."""

from lit_balance.report.figures import PlanReport, distributed_sampler_plan, plan_report, summary_line, write_summary
from lit_balance.report.plots import save_plots
from lit_balance.report.tables import format_report

__all__ = ["PlanReport", "distributed_sampler_plan", "format_report", "plan_report", "save_plots", "summary_line",
           "write_summary"]
