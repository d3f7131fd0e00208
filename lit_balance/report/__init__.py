"""The plan report: an epoch planned two ways, measured, as tables, JSON and plots; a training run's figures as a plot."""

from lit_balance.report.figures import PlanReport, distributed_sampler_plan, plan_report, summary_line, write_summary
from lit_balance.report.plots import read_metrics_csv, save_plots, save_training_plot, training_plot_data
from lit_balance.report.tables import format_report

__all__ = ["PlanReport", "distributed_sampler_plan", "format_report", "plan_report", "read_metrics_csv", "save_plots",
           "save_training_plot", "summary_line", "training_plot_data", "write_summary"]
