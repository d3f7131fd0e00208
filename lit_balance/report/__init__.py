"""The plan report: an epoch planned two ways, measured, as tables, JSON and plots; a training run's figures as a plot;
a mixture's shares per optimizer step."""

from lit_balance.report.figures import (PlanReport, distributed_sampler_plan, mixture_lines, mixture_shares, plan_report,
                                        summary_line, write_summary)
from lit_balance.report.plots import (mixture_figure, read_metrics_csv, save_mixture_plot, save_plots,
                                      save_training_plot, training_plot_data)
from lit_balance.report.tables import format_report, mixture_table

__all__ = ["PlanReport", "distributed_sampler_plan", "format_report", "mixture_figure", "mixture_lines",
           "mixture_shares", "mixture_table", "plan_report", "read_metrics_csv", "save_mixture_plot", "save_plots",
           "save_training_plot", "summary_line", "training_plot_data", "write_summary"]
